package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/urfave/cli/v2"

	"qtool/convert"
	"qtool/formats/kuiper"
	"qtool/formats/model"
)

// exportTargets maps each output flag of `qtool export` to its format
// (a registry name, see convert.Codecs).
var exportTargets = []struct {
	flag    string
	format  string
	usage   string
	aliases []string
}{
	{"fp32", convert.FormatKuiperFP32, "write a Kuiper/llama2.c legacy fp32 file (28-byte header, no magic)", nil},
	{"q8", convert.FormatKuiperInt8, "write a Kuiper int8 file (export.py --version 3: 32-byte header, int8 linears + classifier)", nil},
	{"ak42-v1", convert.FormatAK42V1, "write a llama2.c ak42 version 1 file (fp32)", nil},
	{"ak42-v2", convert.FormatAK42V2, "write a llama2.c ak42 version 2 file (Q8_0)", nil},
	{"ak47", convert.FormatAK47, "write an OrinMLLM ak47 (version 4) Qwen3 fp16 file", []string{"v4"}},
	{"ak48", convert.FormatAK48, "write an OrinMLLM ak48 (version 5) Qwen3 AWQ int4 file: 4-bit inputs (AutoAWQ, GPTQ without g_idx, msmodelslim W4A16) are copied without re-quantizing, float ones RTN-quantized", []string{"v5"}},
}

func exportCommand() *cli.Command {
	flags := []cli.Flag{
		&cli.StringFlag{Name: "hf", Usage: "read a Hugging Face checkpoint directory (float, AutoAWQ or GPTQ)", TakesFile: true},
		&cli.StringFlag{Name: "in", Usage: "read any model qtool opens (directory or Kuiper file)", TakesFile: true},
	}
	for _, t := range exportTargets {
		flags = append(flags, &cli.StringFlag{Name: t.flag, Aliases: t.aliases, Usage: t.usage, TakesFile: true})
	}
	flags = append(flags,
		&cli.IntFlag{Name: "group", Usage: "group size of --q8/--ak42-v2 (default 64) and --ak48 (default 128); a quantized input's own group size when it has one"},
		&cli.StringFlag{Name: "rope", Usage: "q/k layout in the file: half (HF, Kuiper LLAMA3/Qwen builds) or interleaved (Meta, llama2.c, Kuiper's default Llama-2 build); default: interleaved for Llama in --fp32/--ak42-v1/--ak42-v2 (what llama2.c runs), else the input's layout"},
		&cli.IntFlag{Name: "seq-len", Usage: "seq_len written to the header (default: max_position_embeddings)"},
		&cli.BoolFlag{Name: "no-sidecar", Usage: "do not write OUT.json (rope theta, eps, arch, rope layout, tokenizer dir)"},
		qtoolOnlyFlag(),
		&cli.BoolFlag{Name: "quiet", Aliases: []string{"q"}, Usage: "no progress bar"},
	)
	return &cli.Command{
		Name:      "export",
		Usage:     "write a Kuiper / llama2.c / OrinMLLM single-file model",
		UsageText: "qtool export --hf DIR --q8 OUT [--group 64] [--rope interleaved]\n   qtool export --hf DIR --fp32 OUT\n   qtool export --hf QWEN3_AWQ_DIR --v5 OUT    (AutoAWQ Qwen3 → ak48, no re-quantization)",
		Description: "Streams the model tensor by tensor into OUT (written atomically: on error nothing is left)\n" +
			"and writes OUT.json with what the binary format cannot hold, and OUT's size and CRC-32C (a file\n" +
			"beside another run's OUT.json is refused when read). Int8 files always carry a\n" +
			"quantized classifier (vocab = -V), the quantized embedding for tied models.",
		Flags:  flags,
		Action: runExport,
	}
}

func runExport(c *cli.Context) error {
	if c.NArg() > 0 {
		return fmt.Errorf("export: unexpected arguments %q", c.Args().Slice())
	}
	var out, format string
	for _, t := range exportTargets {
		if v := c.String(t.flag); v != "" {
			if out != "" {
				return errors.New("export: give exactly one output flag (--fp32, --q8, --ak42-v1, --ak42-v2, --ak47, --ak48)")
			}
			out, format = v, t.format
		}
	}
	if out == "" {
		return errors.New("export: no output: give one of --fp32, --q8, --ak42-v1, --ak42-v2, --ak47, --ak48")
	}
	rope, err := ropeFlag(c)
	if err != nil {
		return fmt.Errorf("export: %w", err)
	}
	if c.IsSet("group") && c.Int("group") <= 0 {
		return fmt.Errorf("export: --group %d, want > 0", c.Int("group"))
	}
	m, err := openInput(c.String("hf"), c.String("in"))
	if err != nil {
		return err
	}
	defer m.Close()
	// Already quantized weights are written as they are: refuse formats that
	// would re-quantize them (the group size defaults to theirs).
	if err := convert.CanHold(m, format); err != nil {
		return fmt.Errorf("export: %s cannot hold %s without re-quantizing it: %w; formats that can: %s (see qtool convert)",
			format, m.Source, err, strings.Join(convert.Holders(m), ", "))
	}
	if err := convert.CheckShape(format, m.Config, c.Bool("qtool-only")); err != nil {
		return fmt.Errorf("export: %w", err)
	}
	opt := convert.SaveOptions{Rope: rope, GroupSize: c.Int("group"), QtoolOnly: c.Bool("qtool-only"),
		Kuiper: kuiper.WriteOptions{SeqLen: c.Int("seq-len"), NoSidecar: c.Bool("no-sidecar")}}
	var bar *progressbar.ProgressBar
	if !c.Bool("quiet") && isTerminal(os.Stderr) {
		opt.Kuiper.Progress = func(done, total int, name string) {
			if bar == nil {
				bar = progressbar.NewOptions(total, progressbar.OptionSetDescription("export "+format),
					progressbar.OptionSetWriter(os.Stderr), progressbar.OptionShowCount(),
					progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionClearOnFinish())
			}
			bar.Set(done)
		}
	}
	if err := convert.SaveWith(m, format, out, opt); err != nil {
		if bar != nil {
			bar.Exit()
		}
		return err
	}
	if bar != nil {
		bar.Finish()
	}
	fi, err := os.Stat(out)
	if err != nil {
		return err
	}
	side := ""
	if !opt.Kuiper.NoSidecar {
		side = " + " + kuiper.SidecarPath(out)
	}
	fmt.Fprintf(c.App.Writer, "wrote %s (%s, %d bytes)%s\n", out, format, fi.Size(), side)
	noteRTN(c.App.ErrWriter, m, format)
	if note := kuiper.ReaderNote(kuiper.Format(format), m.Config); note != "" {
		fmt.Fprintf(c.App.ErrWriter, "note: %s\n", note)
	}
	return nil
}

// ropeFlag parses --rope: nil when not given (the format's default).
func ropeFlag(c *cli.Context) (*model.RopeLayout, error) {
	var r model.RopeLayout
	switch c.String("rope") {
	case "":
		return nil, nil
	case "half":
		r = model.RopeHalf
	case "interleaved":
		r = model.RopeInterleaved
	default:
		return nil, fmt.Errorf("--rope %q, want half or interleaved", c.String("rope"))
	}
	return &r, nil
}

// noteRTN says which float decoder linears of a partly quantized model (an
// AutoAWQ checkpoint's modules_to_not_convert, say) a quantizing format
// RTN-quantized on the way.
func noteRTN(w io.Writer, m *model.Model, format string) {
	if names := convert.RTNQuantized(m, format); len(names) > 0 {
		if w == nil {
			w = os.Stderr
		}
		fmt.Fprintf(w, "note: %s stores every decoder linear quantized: %d linears the input kept in float were RTN-quantized (%s)\n",
			format, len(names), strings.Join(names, ", "))
	}
}

// openInput opens the model named by --hf or --in.
func openInput(hfDir, in string) (*model.Model, error) {
	switch {
	case hfDir != "" && in != "":
		return nil, errors.New("give either --hf or --in, not both")
	case hfDir != "":
		// convert.Open reads float HF and AutoAWQ/GPTQ directories alike
		// (hf.Open refuses a quantization_config).
		return convert.Open(hfDir)
	case in != "":
		return convert.Open(in)
	}
	return nil, errors.New("no input: give --hf DIR or --in PATH")
}
