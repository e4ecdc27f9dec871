package main

import (
	"errors"
	"fmt"
	"os"
	goruntime "runtime"

	"github.com/urfave/cli/v2"

	"qtool/convert"
	"qtool/quantize"
	"qtool/runtime/cpu"
)

func quantizeCommand() *cli.Command {
	return &cli.Command{
		Name:  "quantize",
		Usage: "round-to-nearest quantization without calibration (the baseline of GPTQ/AWQ)",
		UsageText: "qtool quantize --hf DIR [--bits 4] [--group 128] [--sym] -o OUT [--format autoawq]\n" +
			"   qtool quantize --in model.bin --bits 8 --sym --group 64 -o model.q8 --format kuiper-int8",
		Description: "Quantizes every decoder linear of a float model (--hf DIR or --in PATH, any format qtool reads)\n" +
			"with qtool/quantize's RTN rules: asymmetric (AutoAWQ's zero_point rule: scale = range/(2^bits−1),\n" +
			"integer zero point) or with --sym symmetric (Kuiper's int8 rule: scale = max|w|/(2^(bits−1)−1)),\n" +
			"per group of --group input columns (0: per channel), and writes the result as --format (any format\n" +
			"that can hold it; a format that cannot is refused with the list of those that can).",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "hf", Usage: "Hugging Face checkpoint `DIR` to quantize", TakesFile: true},
			&cli.StringFlag{Name: "in", Usage: "any float model qtool reads (`PATH`)", TakesFile: true},
			&cli.IntFlag{Name: "bits", Value: 4, Usage: "weight bits (2..8)"},
			&cli.IntFlag{Name: "group", Value: 128, Usage: "input columns per scale group (0: per channel)"},
			&cli.BoolFlag{Name: "sym", Usage: "symmetric grid without zero points; default asymmetric"},
			&cli.StringFlag{Name: "format", Value: convert.FormatAutoAWQ, Usage: "output format: autoawq, gptq, msmodelslim, kuiper-int8, ak42-v2 or ak48 (each as it can hold the result)"},
			&cli.StringFlag{Name: "out", Aliases: []string{"o"}, Usage: "output `PATH` (a directory, or a file for Kuiper formats)", TakesFile: true},
			&cli.StringFlag{Name: "rope", Usage: "q/k layout of a Kuiper output: half or interleaved (default: the format's)"},
			qtoolOnlyFlag(),
			&cli.StringFlag{Name: "verify", Usage: "after writing, print the perplexity of the written model on `FILE`", TakesFile: true},
			&cli.IntFlag{Name: "verify-chunks", Usage: "evaluate at most `N` chunks of 512 tokens with --verify (0: all)"},
			&cli.IntFlag{Name: "threads", Usage: "CPU threads of --verify (0: all cores)"},
			&cli.BoolFlag{Name: "quiet", Aliases: []string{"q"}, Usage: "print only the result line"},
		},
		Action: runQuantize,
	}
}

func runQuantize(c *cli.Context) error {
	if c.NArg() > 0 {
		return fmt.Errorf("quantize: unexpected arguments %q", c.Args().Slice())
	}
	out := c.String("out")
	if out == "" {
		return errors.New("quantize: no output: give -o OUT")
	}
	if _, err := os.Stat(out); err == nil {
		return fmt.Errorf("quantize: %s already exists; remove it or choose another -o", out)
	}
	if c.Int("verify-chunks") < 0 || c.Int("threads") < 0 {
		return fmt.Errorf("quantize: --verify-chunks %d --threads %d: want >= 0", c.Int("verify-chunks"), c.Int("threads"))
	}
	p := quantize.Params{Bits: c.Int("bits"), Group: c.Int("group"), Rule: quantize.AsymAWQ}
	if c.Bool("sym") {
		p.Rule = quantize.SymZero
	}
	if err := p.Validate(); err != nil {
		return fmt.Errorf("quantize: --bits %d --group %d: %w", p.Bits, p.Group, err)
	}
	rope, err := ropeFlag(c)
	if err != nil {
		return fmt.Errorf("quantize: %w", err)
	}
	m, err := openInput(c.String("hf"), c.String("in"))
	if err != nil {
		return fmt.Errorf("quantize: %w", err)
	}
	defer m.Close()
	if !convert.IsFloat(m) {
		return fmt.Errorf("quantize: %s (%s) is already quantized; qtool convert writes it in another format without re-quantizing", m.Source, m.Format)
	}
	format, err := checkFormat("quantize", c.String("format"),
		resultKind{bits: p.Bits, group: p.Group, sym: !p.Asymmetric(), arch: m.Config.Arch, bias: m.Config.AttnBias})
	if err != nil {
		return err
	}
	if err := convert.CheckShape(format, m.Config, c.Bool("qtool-only")); err != nil {
		return fmt.Errorf("quantize: %w", err)
	}
	// Lazy: the writers quantize one tensor at a time.
	q, err := quantize.QuantizeModel(m, quantize.Options{Params: p, Lazy: true})
	if err != nil {
		return fmt.Errorf("quantize: %s: %w", m.Source, err)
	}
	if err := convert.SaveWith(q, format, out, convert.SaveOptions{Rope: rope, GroupSize: p.Group, QtoolOnly: c.Bool("qtool-only")}); err != nil {
		return fmt.Errorf("quantize: %w", err)
	}
	w := c.App.Writer
	if w == nil {
		w = os.Stdout
	}
	fmt.Fprintf(w, "wrote %s (%s, RTN %s, from %s %s)\n", out, format, p, m.Format, m.Source)
	if f := c.String("verify"); f != "" {
		threads := c.Int("threads")
		if threads == 0 {
			threads = max(1, goruntime.NumCPU())
		}
		v, err := verifyWritten(out, m.TokenizerDir, f, c.Int("verify-chunks"), cpu.New(threads))
		if err != nil {
			return fmt.Errorf("quantize: --verify: %w", err)
		}
		fmt.Fprintf(w, "verify %s: ppl %.4f (gptq protocol, ctx %d, %d chunks, %d tokens) read back from %s\n",
			f, v.PPL, v.Ctx, v.Chunks, v.Tokens, out)
	}
	return nil
}
