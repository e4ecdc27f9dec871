package main

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/urfave/cli/v2"

	"qtool/convert"
)

func convertCommand() *cli.Command {
	return &cli.Command{
		Name:      "convert",
		Usage:     "rewrite a model in another format without re-quantizing it",
		UsageText: "qtool convert --to FORMAT MODEL -o OUT [--force]\n   qtool convert --list MODEL",
		Description: "Reads MODEL (HF float, AutoAWQ, GPTQ or msmodelslim directory, Kuiper/llama2.c/OrinMLLM file)\n" +
			"and writes it as FORMAT: " + strings.Join(convert.Formats(), ", ") + "\n" +
			"(aliases: awq, ak48, v5, ak47, q8, fp32, ak42-v1, ak42-v2). Quantized weights are kept as they are;\n" +
			"a format that would have to re-quantize them refuses and names the formats that can hold the model.\n" +
			"Float formats (hf, kuiper-fp32, kuiper-ak42-v1, kuiper-ak47) dequantize. AutoAWQ and GPTQ store\n" +
			"scales and other tensors as fp16. OUT appears complete or not at all; a directory that is not\n" +
			"empty is refused unless --force, which replaces it entirely (the old model is removed). Examples:\n" +
			"   qtool convert --to kuiper-v5 qwen3-awq/ -o qwen3.ak48     (seed 002: AutoAWQ → OrinMLLM v5)\n" +
			"   qtool convert --to msmodelslim llama-gptq/ -o llama-w4a16/\n" +
			"   qtool convert --to gptq llama-w8a16/ -o llama-gptq8/       (reverse of Ascend's ms_to_vllm.py)",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "to", Usage: "output format (see above)"},
			&cli.StringFlag{Name: "out", Aliases: []string{"o"}, Usage: "output directory or file", TakesFile: true},
			&cli.BoolFlag{Name: "list", Usage: "print the formats that can hold MODEL and exit"},
			&cli.BoolFlag{Name: "force", Usage: "replace an output directory that already holds a model (the old model is removed entirely)"},
		},
		Action: runConvert,
	}
}

// runConvert implements `qtool convert`. Flags may also follow MODEL
// (`qtool convert --to F MODEL -o OUT`), which urfave/cli leaves in Args.
func runConvert(c *cli.Context) error {
	to, out := c.String("to"), c.String("out")
	var pos []string
	args := c.Args().Slice()
	for i := 0; i < len(args); i++ {
		a := args[i]
		name, val, hasVal := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !strings.HasPrefix(a, "-") || a == "-" {
			pos = append(pos, a)
			continue
		}
		if name == "list" || name == "force" {
			if err := c.Set(name, "true"); err != nil {
				return err
			}
			continue
		}
		if name != "o" && name != "out" && name != "to" {
			return fmt.Errorf("convert: unknown option %q (options: --to FORMAT, -o OUT, --list, --force)", a)
		}
		if !hasVal {
			if i+1 >= len(args) {
				return fmt.Errorf("convert: %s needs a value", a)
			}
			i++
			val = args[i]
		}
		if name == "to" {
			to = val
		} else {
			out = val
		}
	}
	if len(pos) != 1 {
		return fmt.Errorf("convert: want exactly one MODEL argument, got %d: qtool convert --to FORMAT MODEL -o OUT", len(pos))
	}
	m, err := convert.Open(pos[0])
	if err != nil {
		return err
	}
	defer m.Close()
	w := c.App.Writer
	if w == nil {
		w = os.Stdout
	}
	if c.Bool("list") {
		fmt.Fprintf(w, "%s (%s) can be written as: %s\n", pos[0], m.Format, strings.Join(convert.Holders(m), ", "))
		return nil
	}
	if to == "" || out == "" {
		return errors.New("convert: give --to FORMAT and -o OUT (formats: " + strings.Join(convert.Formats(), ", ") + ")")
	}
	f, err := convert.CanonicalFormat(to)
	if err != nil {
		return fmt.Errorf("convert: --to: %w", err)
	}
	if err := convert.SaveWith(m, f, out, convert.SaveOptions{Force: c.Bool("force")}); err != nil {
		return err
	}
	fmt.Fprintf(w, "wrote %s (%s, from %s %s)\n", out, f, m.Format, pos[0])
	return nil
}
