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
		UsageText: "qtool convert --to FORMAT MODEL -o OUT [--force] [--rope half|interleaved] [--tp N] [--qtool-only]\n   qtool convert --list MODEL",
		Description: "Reads MODEL (any format below) and writes it as FORMAT:\n" +
			formatTable() +
			"Quantized weights are kept as they are; a format that would have to re-quantize them refuses and\n" +
			"names the formats that can hold the model. Float formats (hf, kuiper-fp32, ak42-v1, ak47) dequantize.\n" +
			"AutoAWQ and GPTQ store scales and other tensors as fp16. The q/k rows follow the rope layout of each\n" +
			"side: HF-style formats hold the half layout, llama2.c's (kuiper-fp32, ak42-v1, ak42-v2) take Llama\n" +
			"models interleaved, the others keep MODEL's layout and record it (--rope overrides). --to shard\n" +
			"needs --tp N. OUT appears complete or not at all; a directory that is not empty is refused unless\n" +
			"--force, which replaces it entirely (the old model is removed). Examples:\n" +
			"   qtool convert --to ak48 qwen3-awq/ -o qwen3.ak48          (seed 002: AutoAWQ → OrinMLLM v5)\n" +
			"   qtool convert --to msmodelslim llama-gptq/ -o llama-w4a16/\n" +
			"   qtool convert --to gptq llama-w8a16/ -o llama-gptq8/       (reverse of Ascend's ms_to_vllm.py)",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "to", Usage: "output format (see above)"},
			&cli.StringFlag{Name: "out", Aliases: []string{"o"}, Usage: "output directory or file", TakesFile: true},
			&cli.BoolFlag{Name: "list", Usage: "print the formats that can hold MODEL and exit"},
			&cli.StringFlag{Name: "rope", Usage: "q/k layout to write: half or interleaved (default: the format's, see above)"},
			&cli.IntFlag{Name: "tp", Usage: "ranks of a shard directory (--to shard)"},
			qtoolOnlyFlag(),
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
		if name == "list" || name == "qtool-only" || name == "force" {
			if err := c.Set(name, "true"); err != nil {
				return err
			}
			continue
		}
		if name != "o" && name != "out" && name != "to" && name != "rope" && name != "tp" {
			return fmt.Errorf("convert: unknown option %q (options: --to FORMAT, -o OUT, --list, --rope, --tp, --qtool-only, --force)", a)
		}
		if !hasVal {
			if i+1 >= len(args) {
				return fmt.Errorf("convert: %s needs a value", a)
			}
			i++
			val = args[i]
		}
		switch name {
		case "to":
			to = val
		case "o", "out":
			out = val
		default:
			if err := c.Set(name, val); err != nil {
				return fmt.Errorf("convert: --%s: %w", name, err)
			}
		}
	}
	rope, err := ropeFlag(c)
	if err != nil {
		return fmt.Errorf("convert: %w", err)
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
	opt := convert.SaveOptions{Rope: rope, TP: c.Int("tp"), QtoolOnly: c.Bool("qtool-only"), Force: c.Bool("force")}
	if err := convert.SaveWith(m, f, out, opt); err != nil {
		return err
	}
	fmt.Fprintf(w, "wrote %s (%s, from %s %s)\n", out, f, m.Format, pos[0])
	noteRTN(c.App.ErrWriter, m, f)
	return nil
}

// formatTable lists the registry's formats with their aliases, one a line.
func formatTable() string {
	var b strings.Builder
	for _, c := range convert.Codecs() {
		fmt.Fprintf(&b, "   %-12s %s", c.Name, c.Doc)
		if len(c.Aliases) > 0 {
			fmt.Fprintf(&b, " (also %s)", strings.Join(c.Aliases, ", "))
		}
		b.WriteString("\n")
	}
	return b.String()
}
