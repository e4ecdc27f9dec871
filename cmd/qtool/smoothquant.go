package main

import (
	"fmt"
	"qtool/convert"
	"strconv"

	"github.com/urfave/cli/v2"

	"qtool/quantize/calib"
	"qtool/smoothquant"
)

func smoothquantCommand() *cli.Command {
	flags := append(quantFlags(8, 0, convert.FormatMsModelSlim),
		&cli.StringFlag{Name: "alpha", Value: "0.5", Usage: "migration strength in (0, 1), or \"auto\" to search it per scale group"},
		&cli.BoolFlag{Name: "no-act-clip", Usage: "use the plain calibration min/max as the activation range (no range search)"},
		&cli.BoolFlag{Name: "smooth-down", Usage: "also smooth down_proj's input, folding its scales into up_proj's rows"},
	)
	return &cli.Command{
		Name:      "smoothquant",
		Usage:     "W8A8: SmoothQuant migration + int8 weights and static int8 activations",
		UsageText: "qtool smoothquant --hf DIR --calib train.txt [--alpha 0.5|auto] -o OUT [--format msmodelslim]",
		Description: "Scales s = max|X|^α / max|W|^(1-α) are folded into both RMSNorms of every layer; all decoder\n" +
			"linears get per-channel symmetric int8 weights and a static per-tensor asymmetric int8\n" +
			"activation quantizer calibrated on the same windows (msmodelslim W8A8).",
		Flags: flags,
		Action: func(c *cli.Context) error {
			if c.Int("bits") != 8 || c.Int("group") != 0 {
				return fmt.Errorf("smoothquant: W8A8 has 8-bit per-channel weights; --bits %d --group %d are not supported", c.Int("bits"), c.Int("group"))
			}
			opt := smoothquant.Options{ClipSearch: !c.Bool("no-act-clip"), SmoothDown: c.Bool("smooth-down")}
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
				kind: resultKind{bits: 8, w8a8: true},
				run: func(s *calib.Session, p calib.Progress) ([]calib.ModuleStat, error) {
					return smoothquant.QuantizeModel(s, opt, p)
				}})
		},
	}
}
