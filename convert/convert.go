// Package convert opens any model qtool reads, sniffing what a path holds
// (an HF directory, float or AutoAWQ/GPTQ quantized; an msmodelslim
// directory; a Kuiper or llama2.c file), the way image.Decode sniffs image
// formats — but with an explicit table instead of global registration.
//
// Save writes a model in any format qtool writes, by name, without
// re-quantizing weights that are already quantized; CanHold and Holders say
// beforehand which formats can hold a model. Open followed by Save converts
// between formats (AutoAWQ → OrinMLLM ak48, GPTQ/AutoAWQ → msmodelslim
// W4A16, msmodelslim W8A16 → GPTQ 8-bit, ...).
package convert

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"qtool/formats/autoawq"
	"qtool/formats/gptq"
	"qtool/formats/hf"
	"qtool/formats/kuiper"
	"qtool/formats/model"
	"qtool/formats/msmodelslim"
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
	kind, err := Detect(path)
	if err != nil {
		return nil, err
	}
	switch kind {
	case KindHF:
		return hf.Open(path)
	case KindAutoAWQ:
		return autoawq.Open(path)
	case KindGPTQ:
		return gptq.Open(path)
	case KindMsModelSlim:
		return msmodelslim.Open(path)
	case KindKuiper:
		return kuiper.Open(path, opt.Kuiper)
	}
	return nil, fmt.Errorf("%s: %s models cannot be read yet", path, kind)
}

// Kind names what Detect found.
type Kind string

// Kinds of model storage.
const (
	KindHF          Kind = "hf"          // config.json + model*.safetensors, no quantization_config
	KindAutoAWQ     Kind = "autoawq"     // quantization_config.quant_method == "awq"
	KindGPTQ        Kind = "gptq"        // quantization_config.quant_method == "gptq"
	KindMsModelSlim Kind = "msmodelslim" // quant_model_description.json
	KindKuiper      Kind = "kuiper"      // a single file: Kuiper legacy, llama2.c ak42, OrinMLLM ak47/ak48
)

// Detect tells what path holds without reading any weights.
func Detect(path string) (Kind, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return "", err
	}
	if !fi.IsDir() {
		return KindKuiper, nil
	}
	if _, err := os.Stat(filepath.Join(path, "quant_model_description.json")); err == nil {
		return KindMsModelSlim, nil
	}
	data, err := os.ReadFile(filepath.Join(path, "config.json"))
	if err != nil {
		return "", fmt.Errorf("%s: a model directory needs config.json or quant_model_description.json: %w", path, err)
	}
	var raw struct {
		Q *struct {
			Method string `json:"quant_method"`
		} `json:"quantization_config"`
	}
	if err := json.Unmarshal(data, &raw); err != nil {
		return "", fmt.Errorf("%s: %w", filepath.Join(path, "config.json"), err)
	}
	if raw.Q == nil {
		return KindHF, nil
	}
	switch raw.Q.Method {
	case "awq":
		return KindAutoAWQ, nil
	case "gptq":
		return KindGPTQ, nil
	}
	return "", fmt.Errorf("%s: quantization_config.quant_method %q is not supported (supported: awq, gptq)", path, raw.Q.Method)
}
