package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"time"

	"github.com/urfave/cli/v2"

	"qtool/formats/atomicfile"
	"qtool/quantize/report"
)

func reportCommand() *cli.Command {
	return &cli.Command{
		Name:      "report",
		Usage:     "write one self-contained HTML page comparing quantized models of one base",
		ArgsUsage: "INPUT... (quantizer records, `verify --kld --json` results, or model paths)",
		UsageText: "qtool report -o report.html /tmp/g4.quant.json /tmp/g4.kld.json /tmp/a4.quant.json /tmp/a4.kld.json\n" +
			"   qtool report -o report.html /tmp/g4 /tmp/a4 /tmp/rtn4     (reads MODEL.quant.json and MODEL.kld.json beside each)\n" +
			"   qtool gptq --hf testdata/llama-mini --calib testdata/corpus/train-head.txt -o /tmp/g4 --json > /tmp/g4.quant.json\n" +
			"   qtool verify --kld testdata/llama-mini --kld-cache /tmp/mini.kld --ppl testdata/corpus/sotu-test.raw --json /tmp/g4 > /tmp/g4.kld.json",
		Description: "The page holds a summary table (method, scheme, size, bits per parameter on disk, perplexity, KL divergence\n" +
			"from the base with llama.cpp's statistics, top-1 agreement, Δp), charts as inline SVG (mean KLD, perplexity,\n" +
			"top-1 agreement, the per-token KLD histogram, relative output error per layer and per module, quantizer loss)\n" +
			"and the per-module tables with each quantizer's notes (damping, clip and scale choices). It needs no network\n" +
			"and nothing but the JSON files, so a report can be rebuilt later. Inputs: a quantizer's record (MODEL.quant.json,\n" +
			"or its --json summary), a `qtool verify --kld BASE --json MODEL` result (joined to the record of MODEL by path),\n" +
			"or a model path, for which MODEL.quant.json and MODEL.kld.json are read.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "out", Aliases: []string{"o"}, Usage: "write the page to `FILE`", Required: true, TakesFile: true},
			&cli.StringFlag{Name: "title", Usage: "page title"},
			&cli.BoolFlag{Name: "json", Usage: "also print the merged inputs (every figure on the page) as JSON"},
		},
		Action: runReport,
	}
}

func runReport(c *cli.Context) error {
	if c.NArg() == 0 {
		return fmt.Errorf("report: no inputs: qtool report -o FILE INPUT... (see `qtool report --help`)")
	}
	entries, err := report.Load(c.Args().Slice())
	if err != nil {
		return err
	}
	var b bytes.Buffer
	if err := report.Write(&b, entries, report.Options{Title: c.String("title"), Generated: time.Now()}); err != nil {
		return fmt.Errorf("report: %w", err)
	}
	out := c.String("out")
	if err := atomicfile.WriteFile(out, b.Bytes()); err != nil {
		return fmt.Errorf("report: %w", err)
	}
	stdout, _, logf := outputs(c)
	if c.Bool("json") {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(struct {
			Out     string         `json:"out"`
			Bytes   int            `json:"bytes"`
			Entries []report.Entry `json:"entries"`
		}{out, b.Len(), entries})
	}
	logf("wrote %s (%d models, %.0f KB)\n", out, len(entries), float64(b.Len())/1e3)
	return nil
}
