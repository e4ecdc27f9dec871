package main

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/urfave/cli/v2"

	"qtool/convert"
	"qtool/formats/kuiper"
	"qtool/formats/model"
)

// exportTargets maps each output flag of `qtool export` to its format.
var exportTargets = []struct {
	flag    string
	format  kuiper.Format
	usage   string
	aliases []string
}{
	{"fp32", kuiper.FP32, "write a Kuiper/llama2.c legacy fp32 file (28-byte header, no magic)", nil},
	{"q8", kuiper.Int8, "write a Kuiper int8 file (export.py --version 3: 32-byte header, int8 linears + classifier)", nil},
	{"ak42-v1", kuiper.AK42V1, "write a llama2.c ak42 version 1 file (fp32)", nil},
	{"ak42-v2", kuiper.AK42V2, "write a llama2.c ak42 version 2 file (Q8_0)", nil},
	{"ak47", kuiper.AK47, "write an OrinMLLM ak47 (version 4) Qwen3 fp16 file", []string{"v4"}},
	{"ak48", kuiper.AK48, "write an OrinMLLM ak48 (version 5) Qwen3 AWQ int4 file: 4-bit inputs (AutoAWQ, GPTQ without g_idx, msmodelslim W4A16) are copied without re-quantizing, float ones RTN-quantized", []string{"v5"}},
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
		&cli.StringFlag{Name: "rope", Value: "half", Usage: "q/k layout in the file: half (HF, Kuiper LLAMA3/Qwen builds) or interleaved (Meta, Kuiper's default Llama-2 build)"},
		&cli.IntFlag{Name: "seq-len", Usage: "seq_len written to the header (default: max_position_embeddings)"},
		&cli.BoolFlag{Name: "no-sidecar", Usage: "do not write OUT.json (rope theta, eps, arch, tokenizer dir)"},
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
	var out string
	var format kuiper.Format
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
	var rope model.RopeLayout
	switch c.String("rope") {
	case "half":
		rope = model.RopeHalf
	case "interleaved":
		rope = model.RopeInterleaved
	default:
		return fmt.Errorf("export: --rope %q, want half or interleaved", c.String("rope"))
	}
	m, err := openInput(c.String("hf"), c.String("in"))
	if err != nil {
		return err
	}
	defer m.Close()
	opt := kuiper.WriteOptions{Format: format, GroupSize: c.Int("group"), Rope: rope, SeqLen: c.Int("seq-len"),
		NoSidecar: c.Bool("no-sidecar")}
	if c.IsSet("group") && c.Int("group") <= 0 {
		return fmt.Errorf("export: --group %d, want > 0", c.Int("group"))
	}
	// Already quantized weights are written as they are: refuse formats that
	// would re-quantize them, and default the group size to theirs.
	if err := convert.CanHold(m, string(format)); err != nil {
		return fmt.Errorf("export: %s cannot hold %s without re-quantizing it: %w; formats that can: %s (see qtool convert)",
			format, m.Source, err, strings.Join(convert.Holders(m), ", "))
	}
	if g := convert.GroupSize(m); !c.IsSet("group") && g > 0 && (format == kuiper.AK48 || format == kuiper.Int8 || format == kuiper.AK42V2) {
		opt.GroupSize = g
	}
	var bar *progressbar.ProgressBar
	if !c.Bool("quiet") && isTerminal(os.Stderr) {
		opt.Progress = func(done, total int, name string) {
			if bar == nil {
				bar = progressbar.NewOptions(total, progressbar.OptionSetDescription("export "+string(format)),
					progressbar.OptionSetWriter(os.Stderr), progressbar.OptionShowCount(),
					progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionClearOnFinish())
			}
			bar.Set(done)
		}
	}
	if err := kuiper.Write(m, out, opt); err != nil {
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
	if !opt.NoSidecar {
		side = " + " + kuiper.SidecarPath(out)
	}
	fmt.Fprintf(c.App.Writer, "wrote %s (%s, %d bytes)%s\n", out, format, fi.Size(), side)
	return nil
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
