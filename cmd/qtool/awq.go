package main

import (
	"fmt"

	"github.com/urfave/cli/v2"

	"qtool/awq"
	"qtool/convert"
	"qtool/gptq"
	"qtool/quantize/calib"
)

func awqCommand() *cli.Command {
	flags := append(quantFlags(4, 128, convert.FormatAutoAWQ),
		&cli.BoolFlag{Name: "duo-scaling", Usage: "AutoAWQ's s = x^r / w^(1-r) grid instead of llm-awq's s = x^r"},
		&cli.BoolFlag{Name: "no-clip", Usage: "skip the clipping search"},
		&cli.IntFlag{Name: "search-tokens", Value: 4096, Usage: "calibration tokens used to score each scale candidate"},
		&cli.BoolFlag{Name: "gptq", Usage: "quantize the scaled weights with GPTQ (Hessian-aware rounding) instead of round-to-nearest"},
	)
	return &cli.Command{
		Name:  "awq",
		Usage: "quantize weights with AWQ (activation-aware scaling + clipping) on calibration text",
		UsageText: "qtool awq --hf DIR --calib train.txt [--bits 4] [--group 128] -o OUT [--format autoawq]\n" +
			"   qtool awq --hf qwen3-dir --calib train.txt -o model.ak48 --format ak48",
		Description: "Per decoder layer: grid-searches (20 points) the per-channel scale exponent of each scale group\n" +
			"(input norm → q/k/v; v → o when the shapes match; post-attention norm → gate/up; up → down),\n" +
			"folds the scales into the previous op, searches each weight's clipping range (shrink to 0.5 in\n" +
			"20ths, q/k skipped) and quantizes asymmetrically per group with fp16 scales.",
		Flags: flags,
		Action: func(c *cli.Context) error {
			bits := c.Int("bits")
			if bits < 2 || bits > 8 {
				return fmt.Errorf("awq: --bits %d, want 2..8", bits)
			}
			if c.Int("group") <= 0 {
				return fmt.Errorf("awq: --group %d, want > 0", c.Int("group"))
			}
			opt := awq.Options{Bits: bits, GroupSize: c.Int("group"), DuoScaling: c.Bool("duo-scaling"),
				NoClip: c.Bool("no-clip"), SearchTokens: c.Int("search-tokens")}
			if c.Bool("gptq") {
				opt.GPTQ = &gptq.Options{Search: "hmse"}
			}
			return runQuant(c, quantJob{cmd: "awq", loss: "block mse",
				kind: resultKind{bits: bits, group: opt.GroupSize},
				run: func(s *calib.Session, p calib.Progress) ([]calib.ModuleStat, error) {
					return awq.QuantizeModel(s, opt, p)
				}})
		},
	}
}
