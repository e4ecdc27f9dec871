// Package convert is qtool's formats registry: one table of codecs (Codecs;
// canonical name, aliases, detection, reader, writer and what each format
// can hold) that every command and the tensor-parallel loader use. Open
// reads any model qtool reads, sniffing what a path holds (an HF directory,
// float or AutoAWQ/GPTQ quantized; an msmodelslim directory; a qtool shard
// directory; a Kuiper, llama2.c or OrinMLLM file), the way image.Decode
// sniffs image formats — but with an explicit table instead of global
// registration.
//
// Save writes a model in any format qtool writes, by name, without
// re-quantizing weights that are already quantized; CanHold and Holders say
// beforehand which formats can hold a model. Open followed by Save converts
// between formats (AutoAWQ → OrinMLLM ak48, GPTQ/AutoAWQ → msmodelslim
// W4A16, msmodelslim W8A16 → GPTQ 8-bit, ...), keeping the q/k rows right
// for the rope layout of each side (see SaveOptions.Rope).
package convert

import (
	"qtool/formats/kuiper"
	"qtool/formats/model"
)

// Options carries codec-specific settings for OpenWith.
type Options struct {
	// Kuiper overrides what a Kuiper/llama2.c file cannot say about itself
	// (architecture, rope theta and layout, tokenizer location) when its
	// sidecar JSON is absent.
	Kuiper kuiper.OpenOptions
}

// Open reads the model at path with the codec that recognises it.
func Open(path string) (*model.Model, error) { return OpenWith(path, Options{}) }

// OpenWith is Open with codec options.
func OpenWith(path string, opt Options) (*model.Model, error) {
	c, err := DetectCodec(path, opt)
	if err != nil {
		return nil, err
	}
	return c.open(path, opt)
}

// Kind names the family of storage Detect found (Codec.Kind).
type Kind string

// Kinds of model storage.
const (
	KindHF          Kind = "hf"          // config.json + model*.safetensors, no quantization_config
	KindAutoAWQ     Kind = "autoawq"     // quantization_config.quant_method == "awq"
	KindGPTQ        Kind = "gptq"        // quantization_config.quant_method == "gptq"
	KindMsModelSlim Kind = "msmodelslim" // quant_model_description.json
	KindShard       Kind = "shard"       // manifest.json + rank-N.safetensors
	KindKuiper      Kind = "kuiper"      // a single file: Kuiper legacy, llama2.c ak42, OrinMLLM ak47/ak48
)

// Detect tells what path holds without reading any weights.
func Detect(path string) (Kind, error) {
	c, err := DetectCodec(path, Options{})
	if err != nil {
		return "", err
	}
	return c.Kind, nil
}
