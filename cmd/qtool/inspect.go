package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"text/tabwriter"

	"github.com/urfave/cli/v2"

	"qtool/convert"
	"qtool/formats/kuiper"
	"qtool/formats/model"
	"qtool/formats/shard"
)

func inspectCommand() *cli.Command {
	return &cli.Command{
		Name:      "inspect",
		Usage:     "print a model file's header, tensors and quantization statistics",
		ArgsUsage: "PATH",
		UsageText: "qtool inspect model.bin\n   qtool inspect --json --source testdata/llama-mini /tmp/m.bin    (max dequantization error per tensor)",
		Description: "PATH is a Kuiper/llama2.c/OrinMLLM file (only its header is read unless --stats or\n" +
			"--source is given) or a model directory (any format the registry reads, shard directories\n" +
			"included). The q/k rope layout is shown with where it comes from. With --source DIR (the float model it came from)\n" +
			"the max abs dequantization error of every tensor is printed.",
		Flags: []cli.Flag{
			&cli.BoolFlag{Name: "json", Usage: "print JSON"},
			&cli.BoolFlag{Name: "stats", Usage: "read the tensors: scale statistics of quantized tensors"},
			&cli.StringFlag{Name: "source", Usage: "float model to compare against (max abs dequantization error per tensor)", TakesFile: true},
		},
		Action: runInspect,
	}
}

// inspectReport is what inspect prints (as JSON with --json).
type inspectReport struct {
	Path     string          `json:"path"`
	Format   string          `json:"format"`
	FileSize int64           `json:"file_size,omitempty"`
	Header   *kuiper.Header  `json:"header,omitempty"`
	Sidecar  *kuiper.Sidecar `json:"sidecar,omitempty"`
	Config   model.Config    `json:"config"`
	// Rope is the q/k row layout and where it comes from.
	Rope    string         `json:"rope_layout"`
	Notes   []string       `json:"notes,omitempty"`
	Tensors []tensorReport `json:"tensors"`
}

type tensorReport struct {
	Name   string `json:"name"`
	Type   string `json:"type"`
	Shape  []int  `json:"shape"`
	Offset int64  `json:"offset,omitempty"`
	Bytes  int64  `json:"bytes,omitempty"`
	// Quantization statistics (with --stats or --source).
	Bits       int      `json:"bits,omitempty"`
	GroupSize  int      `json:"group_size,omitempty"`
	ScaleMin   float32  `json:"scale_min,omitempty"`
	ScaleMax   float32  `json:"scale_max,omitempty"`
	ZeroScales int      `json:"zero_scales,omitempty"`
	MaxAbsErr  *float64 `json:"max_abs_err,omitempty"`
	Source     string   `json:"source_tensor,omitempty"`
	// Extension marks tensors qtool appends after the standard layout.
	Extension bool `json:"qtool_extension,omitempty"`
}

func runInspect(c *cli.Context) error {
	if c.NArg() != 1 {
		return fmt.Errorf("inspect: want exactly one PATH, got %d arguments", c.NArg())
	}
	path := c.Args().First()
	rep, err := inspect(path, c.Bool("stats") || c.String("source") != "", c.String("source"))
	if err != nil {
		return err
	}
	if c.Bool("json") {
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	return printReport(c.App.Writer, rep)
}

func inspect(path string, stats bool, source string) (*inspectReport, error) {
	codec, err := convert.DetectCodec(path, convert.Options{})
	if err != nil {
		return nil, err
	}
	rep := &inspectReport{Path: path}
	var m *model.Model
	if codec.Kind != convert.KindKuiper { // Kuiper files: the header alone, below
		if m, err = convert.Open(path); err != nil {
			return nil, err
		}
		defer m.Close()
		rep.Format, rep.Config = m.Format, m.Config
		rep.Rope = m.Config.Rope.String()
		if m.Format == convert.FormatShard {
			rep.Rope += " (recorded in the manifest)"
		}
		for _, n := range m.SortedNames() {
			t, _ := m.Lookup(n)
			rep.Tensors = append(rep.Tensors, tensorReport{Name: n, Type: typeName(t), Shape: t.Shape()})
		}
	} else {
		info, err := kuiper.DecodeHeader(path, kuiper.OpenOptions{})
		if err != nil {
			return nil, err
		}
		h := info.Header
		rep.Format, rep.FileSize, rep.Header, rep.Sidecar, rep.Config = string(h.Format), info.FileSize, &h, info.Sidecar, info.Config
		rep.Rope = info.Config.Rope.String()
		if info.Sidecar != nil && info.Sidecar.RopeLayout != "" {
			rep.Rope += " (recorded in the sidecar)"
		} else {
			rep.Rope += " (assumed: no sidecar records it)"
		}
		if err := kuiper.ReaderCompatible(h.Format, info.Config); err != nil {
			rep.Notes = append(rep.Notes, fmt.Sprintf("a qtool-only file: %v", err))
		} else if note := kuiper.ReaderNote(h.Format, info.Config); note != "" {
			rep.Notes = append(rep.Notes, note)
		}
		for _, e := range info.Layout.Entries {
			rep.Tensors = append(rep.Tensors, tensorReport{Name: e.Name, Type: e.Kind.String(), Shape: e.Shape, Offset: e.Offset, Bytes: e.Size, Extension: e.Extension})
		}
		if stats {
			if m, err = kuiper.Open(path, kuiper.OpenOptions{}); err != nil {
				return nil, err
			}
			defer m.Close()
		}
	}
	if !stats || m == nil {
		return rep, nil
	}
	var src *model.Model
	if source != "" {
		if src, err = convert.Open(source); err != nil {
			return nil, err
		}
		defer src.Close()
	}
	for i := range rep.Tensors {
		tr := &rep.Tensors[i]
		t, ok := m.Lookup(tr.Name)
		if !ok {
			continue
		}
		if q, ok := t.(*model.Quantized); ok {
			tr.Bits, tr.GroupSize = q.Bits, q.GroupSize
			tr.ScaleMin, tr.ScaleMax = float32(math.Inf(1)), float32(math.Inf(-1))
			for _, s := range q.Scale {
				tr.ScaleMin, tr.ScaleMax = min(tr.ScaleMin, s), max(tr.ScaleMax, s)
				if s == 0 {
					tr.ZeroScales++
				}
			}
		}
		if src == nil {
			continue
		}
		e, sname, err := compareTensor(m, src, tr.Name, t)
		if err != nil {
			return nil, fmt.Errorf("inspect %s: tensor %q: %w", path, tr.Name, err)
		}
		tr.MaxAbsErr, tr.Source = &e, sname
	}
	return rep, nil
}

// compareTensor returns the max abs difference between t (tensor name of m)
// and the corresponding source tensor, undoing the tied-classifier and rope
// layout differences a Kuiper export introduces.
func compareTensor(m, src *model.Model, name string, t model.Tensor) (float64, string, error) {
	sname := name
	if name == model.Name(-1, model.LMHead) && src.Config.Tied {
		sname = model.Name(-1, model.Embed)
	}
	st, err := src.Get(sname)
	if err != nil {
		return 0, "", err
	}
	want, err := st.Float32()
	if err != nil {
		return 0, "", err
	}
	got, err := t.Float32()
	if err != nil {
		return 0, "", err
	}
	if len(got) != len(want) {
		return 0, "", fmt.Errorf("%d values, source %q has %d", len(got), sname, len(want))
	}
	if perm := model.RopeRows(src.Config, name, m.Config.Rope); perm != nil {
		p, err := model.PermuteRows(model.FromFloat32(st.Shape(), want), perm)
		if err != nil {
			return 0, "", err
		}
		if want, err = p.Float32(); err != nil {
			return 0, "", err
		}
	}
	var e float64
	for i := range got {
		e = max(e, math.Abs(float64(got[i])-float64(want[i])))
	}
	return e, sname, nil
}

func typeName(t model.Tensor) string {
	switch v := t.(type) {
	case *model.Dense:
		return v.DType.String()
	case *model.Quantized:
		s := fmt.Sprintf("Q%d", v.Bits)
		if v.Zero != nil {
			s += " asym"
		}
		return fmt.Sprintf("%s g%d", s, v.GroupSize)
	case *model.W8A8:
		switch {
		case v.Dynamic:
			return "W8A8 dynamic"
		case v.Sparse:
			return "W8A8S"
		}
		return "W8A8"
	case *shard.Tensor:
		part := "?"
		if len(v.Parts) > 0 {
			part = typeName(v.Parts[0])
		}
		return fmt.Sprintf("%s ×%d %s", part, len(v.Parts), v.Entry.Split)
	}
	return fmt.Sprintf("%T", t)
}

func printReport(w io.Writer, r *inspectReport) error {
	fmt.Fprintf(w, "%s: %s", r.Path, r.Format)
	if r.FileSize > 0 {
		fmt.Fprintf(w, ", %d bytes", r.FileSize)
	}
	fmt.Fprintln(w)
	if h := r.Header; h != nil {
		fmt.Fprintf(w, "header (%d bytes):", h.Size())
		if h.Magic != 0 {
			fmt.Fprintf(w, " magic %#08x version %d", h.Magic, h.Version)
		}
		fmt.Fprintf(w, " dim %d hidden_dim %d n_layers %d n_heads %d n_kv_heads %d vocab_size %d seq_len %d shared_classifier %v",
			h.Dim, h.FFN, h.Layers, h.Heads, h.KVHeads, h.RawVocab, h.SeqLen, h.Shared)
		if h.GroupSize > 0 {
			fmt.Fprintf(w, " group_size %d", h.GroupSize)
		}
		if h.HeadDim > 0 {
			fmt.Fprintf(w, " head_dim %d", h.HeadDim)
		}
		fmt.Fprintln(w)
		if r.Sidecar != nil {
			s := r.Sidecar
			fmt.Fprintf(w, "sidecar: arch %s rope_theta %g rms_norm_eps %g rope %s tied %v head_dim %d tokenizer %q\n",
				s.Arch, s.RopeTheta, s.NormEps, s.RopeLayout, s.Tied, s.HeadDim, s.TokenizerDir)
		} else {
			fmt.Fprintln(w, "sidecar: none (defaults assumed)")
		}
	}
	fmt.Fprintf(w, "rope layout: %s\n", r.Rope)
	for _, n := range r.Notes {
		fmt.Fprintf(w, "note: %s\n", n)
	}
	c := r.Config
	fmt.Fprintf(w, "config: %s hidden %d intermediate %d layers %d heads %d/%d head_dim %d vocab %d max_seq %d theta %g eps %g tied %v rope %s\n",
		c.Arch, c.Hidden, c.Intermediate, c.Layers, c.Heads, c.KVHeads, c.HeadDim, c.Vocab, c.MaxSeq, c.RopeTheta, c.NormEps, c.Tied, c.Rope)
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "tensor\ttype\tshape\toffset\tbytes\tscales\tmax|err|")
	for _, t := range r.Tensors {
		sc, e := "", ""
		if t.Bits > 0 {
			sc = fmt.Sprintf("[%.3g, %.3g]", t.ScaleMin, t.ScaleMax)
			if t.ZeroScales > 0 {
				sc += fmt.Sprintf(" %d zero", t.ZeroScales)
			}
		}
		if t.MaxAbsErr != nil {
			e = fmt.Sprintf("%.3g", *t.MaxAbsErr)
		}
		name := t.Name
		if t.Extension {
			name += " (ext)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%v\t%d\t%d\t%s\t%s\n", name, t.Type, t.Shape, t.Offset, t.Bytes, sc, e)
	}
	return tw.Flush()
}
