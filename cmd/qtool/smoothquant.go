package main

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/urfave/cli/v2"

	"qtool/convert"
	"qtool/gptq"
	"qtool/quantize/calib"
	"qtool/smoothquant"
)

func smoothquantCommand() *cli.Command {
	flags := append(quantFlags(8, 0, convert.FormatMsModelSlim),
		&cli.StringFlag{Name: "alpha", Value: "0.5", Usage: "migration strength in (0, 1), or \"auto\" to search it per scale group"},
		&cli.BoolFlag{Name: "no-act-clip", Usage: "use the plain calibration min/max as the activation range (no range search)"},
		&cli.BoolFlag{Name: "smooth-down", Usage: "also smooth down_proj's input, folding its scales into up_proj's rows"},
		&cli.StringFlag{Name: "weights", Value: "rtn", Usage: "how the smoothed weights become int8: rtn (round to nearest), gptq (Hessian-aware rounding), sparsegpt (prune to --sparsity with the Hessian's compensation, rounding jointly: W8A8S) or magnitude (prune the smallest |w| to --sparsity, then round: W8A8S)"},
		&cli.StringFlag{Name: "sparsity", Usage: "with --weights sparsegpt or magnitude: a fraction of each row (0.5) or N:M (2:4)"},
		&cli.StringFlag{Name: "act", Value: "static", Usage: "activation quantization: static (one calibrated per-tensor range, msmodelslim W8A8) or dynamic (per token at run time, symmetric: W8A8_DYNAMIC)"},
	)
	return &cli.Command{
		Name:  "smoothquant",
		Usage: "W8A8: SmoothQuant migration + int8 weights and static int8 activations",
		UsageText: "qtool smoothquant --hf DIR --calib train.txt [--alpha 0.5|auto] -o OUT [--format msmodelslim]\n" +
			"   qtool smoothquant --hf DIR --calib train.txt --act dynamic --kv-cache int8 -o OUT --verify sotu-test.raw\n" +
			"   qtool smoothquant --hf DIR --calib train.txt --weights sparsegpt --sparsity 2:4 -o OUT   (W8A8S)",
		Description: "Scales s = max|X|^α / max|W|^(1-α) are folded into both RMSNorms of every layer; all decoder\n" +
			"linears get per-channel symmetric int8 weights and a static per-tensor asymmetric int8\n" +
			"activation quantizer calibrated on the same windows (msmodelslim W8A8); with --act dynamic each\n" +
			"token's activations get their own symmetric scale max|x|/127 at run time (W8A8_DYNAMIC).\n" +
			"--kv-cache int8 adds msmodelslim's C8 int8 KV cache.",
		Flags: flags,
		Action: func(c *cli.Context) error {
			if c.Int("bits") != 8 || c.Int("group") != 0 {
				return fmt.Errorf("smoothquant: W8A8 has 8-bit per-channel weights; --bits %d --group %d are not supported", c.Int("bits"), c.Int("group"))
			}
			opt := smoothquant.Options{ClipSearch: !c.Bool("no-act-clip"), SmoothDown: c.Bool("smooth-down")}
			opt.Weights = c.String("weights")
			sparse := false
			switch opt.Weights {
			case "rtn", "gptq":
				if c.IsSet("sparsity") {
					return fmt.Errorf("smoothquant: --sparsity needs --weights sparsegpt or magnitude")
				}
			case "sparsegpt", "magnitude":
				sp, err := parseSparsity(c.String("sparsity"))
				if err != nil {
					return fmt.Errorf("smoothquant: %w", err)
				}
				opt.Sparse, sparse = sp, true
			default:
				return fmt.Errorf("smoothquant: --weights %q: want rtn, gptq, sparsegpt or magnitude", opt.Weights)
			}
			switch act := c.String("act"); act {
			case "static":
			case "dynamic":
				opt.Dynamic = true
			default:
				return fmt.Errorf("smoothquant: --act %q: want static or dynamic", act)
			}
			if a := c.String("alpha"); a == "auto" {
				opt.AutoAlpha = true
			} else {
				v, err := strconv.ParseFloat(a, 64)
				if err != nil || v <= 0 || v >= 1 {
					return fmt.Errorf("smoothquant: --alpha %q: want a number in (0, 1) or auto", a)
				}
				opt.Alpha = v
			}
			return runQuant(c, quantJob{cmd: "smoothquant", loss: "rel out err",
				kind: resultKind{bits: 8, w8a8: true, dynamic: opt.Dynamic, sparse: sparse},
				run: func(s *calib.Session, p calib.Progress) ([]calib.ModuleStat, error) {
					return smoothquant.QuantizeModel(s, opt, p)
				}})
		},
	}
}

// parseSparsity reads --sparsity: a fraction in (0, 1) or N:M.
func parseSparsity(v string) (gptq.SparseOptions, error) {
	if v == "" {
		return gptq.SparseOptions{}, fmt.Errorf("--sparsity is needed: a fraction (0.5) or N:M (2:4)")
	}
	if n, m, ok := strings.Cut(v, ":"); ok {
		N, err1 := strconv.Atoi(n)
		M, err2 := strconv.Atoi(m)
		if err1 != nil || err2 != nil || N <= 0 || N >= M {
			return gptq.SparseOptions{}, fmt.Errorf("--sparsity %q: want N:M with 0 < N < M", v)
		}
		return gptq.SparseOptions{N: N, M: M}, nil
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || !(f > 0 && f < 1) {
		return gptq.SparseOptions{}, fmt.Errorf("--sparsity %q: want a fraction in (0, 1) or N:M", v)
	}
	return gptq.SparseOptions{Sparsity: f}, nil
}
