package main

import (
	"fmt"

	"github.com/urfave/cli/v2"

	"qtool/convert"
	"qtool/gptq"
	"qtool/quantize/calib"
)

func gptqCommand() *cli.Command {
	flags := append(quantFlags(4, 128, convert.FormatGPTQ),
		&cli.BoolFlag{Name: "sym", Usage: "symmetric grid (zero point 2^(bits-1)); default asymmetric"},
		&cli.BoolFlag{Name: "act-order", Usage: "quantize columns by decreasing Hessian diagonal (static groups: plain per-group result)"},
		&cli.Float64Flag{Name: "damp", Value: 0.01, Usage: "Hessian damping as a fraction of its mean diagonal"},
		&cli.IntFlag{Name: "block", Value: 128, Usage: "columns per lazy-update block"},
		&cli.StringFlag{Name: "range", Value: "hmse", Usage: "group range: minmax (the reference implementation), mse (shrink to min Σ|w-q|^2.4) or hmse (shrink to min Σ H_ii (w-q)²)"},
	)
	return &cli.Command{
		Name:  "gptq",
		Usage: "quantize weights with GPTQ (Hessian-aware rounding) on calibration text",
		UsageText: "qtool gptq --hf DIR --calib train.txt [--bits 4] [--group 128] [--act-order] -o OUT [--format gptq]\n" +
			"   qtool gptq --hf DIR --calib train.txt --bits 8 --sym --group 64 -o model.bin --format kuiper-int8",
		Description: "Runs the model layer by layer over --nsamples windows of --seqlen tokens (evenly spaced through\n" +
			"the calibration text), accumulates H = 2XXᵀ/n for each linear group (q/k/v, o, gate/up, down in\n" +
			"that order, each on the outputs of the already quantized ones) and quantizes column by column,\n" +
			"spreading each rounding error with the inverse Hessian. Prints GPTQ's loss per module.",
		Flags: flags,
		Action: func(c *cli.Context) error {
			bits := c.Int("bits")
			switch bits {
			case 2, 3, 4, 8:
			default:
				return fmt.Errorf("gptq: --bits %d, want 2, 3, 4 or 8", bits)
			}
			if c.Int("group") < 0 {
				return fmt.Errorf("gptq: --group %d, want >= 0", c.Int("group"))
			}
			opt := gptq.Options{Bits: bits, GroupSize: c.Int("group"), Sym: c.Bool("sym"), ActOrder: c.Bool("act-order"),
				Damp: c.Float64("damp"), BlockSize: c.Int("block"), Search: c.String("range")}
			switch opt.Search {
			case "minmax", "mse", "hmse":
			default:
				return fmt.Errorf("gptq: --range %q, want minmax, mse or hmse", opt.Search)
			}
			if opt.Damp <= 0 || opt.Damp >= 1 {
				return fmt.Errorf("gptq: --damp %g, want a fraction in (0, 1)", opt.Damp)
			}
			return runQuant(c, quantJob{cmd: "gptq", loss: "gptq loss",
				kind: resultKind{bits: bits, group: opt.GroupSize, sym: opt.Sym},
				run: func(s *calib.Session, p calib.Progress) ([]calib.ModuleStat, error) {
					return gptq.QuantizeModel(s, opt, p)
				}})
		},
	}
}
