package main

import (
	"fmt"
	"math"

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
		&cli.BoolFlag{Name: "asym", Usage: "asymmetric calibration: round each linear to reproduce the float model's output from the quantized model's input, and refit the classifier (runs the float model alongside)"},
		&cli.Float64Flag{Name: "resid", Value: 0.5, Usage: "with --asym: share (0..1) of the gap between the float and the quantized residual stream that o and down correct"},
		&cli.BoolFlag{Name: "head", Value: true, Usage: "with --asym: refit the float classifier (lm_head) to the float model's logits; a tied one becomes an untied lm_head (--head=false keeps it)"},
	)
	return &cli.Command{
		Name:  "gptq",
		Usage: "quantize weights with GPTQ (Hessian-aware rounding) on calibration text",
		UsageText: "qtool gptq --hf DIR --calib train.txt [--bits 4] [--group 128] [--act-order] -o OUT [--format gptq]\n" +
			"   qtool gptq --hf DIR --calib train.txt --bits 8 --sym --group 64 -o model.bin --format kuiper-int8\n" +
			"   qtool gptq --hf DIR --calib train.txt --bits 3 --asym -o OUT --verify sotu-test.raw\n" +
			"   qtool gptq --hf DIR --calib train.txt --asym --resid 0 --head=false -o OUT --json",
		Description: "Runs the model layer by layer over --nsamples windows of --seqlen tokens (evenly spaced through\n" +
			"the calibration text), accumulates H = 2XXᵀ/n for each linear group (q/k/v, o, gate/up, down in\n" +
			"that order, each on the outputs of the already quantized ones) and quantizes column by column,\n" +
			"spreading each rounding error with the inverse Hessian. Prints GPTQ's loss per module.\n\n" +
			"--asym runs the float model beside the quantized one and rounds each linear towards the weight that\n" +
			"maps the quantized inputs to the float model's outputs (W + W(X−X̃)ᵀX̃(X̃ᵀX̃+λI)⁻¹; o and down also\n" +
			"towards --resid of the gap between the two residual streams), so each layer corrects the error of\n" +
			"the layers before it; then the float classifier is refit the same way (--head). The file holds\n" +
			"ordinary quantized linears (and a float lm_head). The table adds each module's error against the\n" +
			"float model's output (float err). It takes about twice GPTQ's time, and needs enough calibration\n" +
			"tokens: the classifier is kept below 8 × hidden_size tokens.",
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
			method := "gptq"
			if c.Bool("asym") {
				method = "gptq --asym"
				opt.Asym = &gptq.Asym{Resid: c.Float64("resid"), Head: c.Bool("head")}
				if r := opt.Asym.Resid; r < 0 || r > 1 || math.IsNaN(r) {
					return fmt.Errorf("gptq: --resid %g, want 0..1", r)
				}
			} else {
				for _, f := range []string{"resid", "head"} {
					if c.IsSet(f) {
						return fmt.Errorf("gptq: --%s applies to --asym only", f)
					}
				}
			}
			return runQuant(c, quantJob{cmd: "gptq", method: method, loss: "gptq loss",
				kind: resultKind{bits: bits, group: opt.GroupSize, sym: opt.Sym},
				run: func(s *calib.Session, p calib.Progress) ([]calib.ModuleStat, error) {
					return gptq.QuantizeModel(s, opt, p)
				}})
		},
	}
}
