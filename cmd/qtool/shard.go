package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/urfave/cli/v2"

	"qtool/convert"
	"qtool/formats/shard"
)

func shardCommand() *cli.Command {
	return &cli.Command{
		Name:      "shard",
		Usage:     "split a model for tensor parallelism: one file per rank plus a manifest",
		ArgsUsage: "MODEL -o DIR",
		UsageText: "qtool shard --tp N MODEL -o DIR",
		Description: "Splits MODEL (any model qtool reads: float, int8, AWQ/GPTQ int4, msmodelslim, a shard directory\n" +
			"to re-shard) over N ranks,\n" +
			"Megatron style: q/k/v/gate/up on the output dimension (whole heads per rank), o/down on the\n" +
			"input dimension, the embedding and lm_head on the vocabulary, norms replicated. Writes\n" +
			"DIR/rank-<r>.safetensors for every rank, the tokenizer files and DIR/manifest.json (the\n" +
			"split dimension and range of every tensor). N must divide the attention and KV heads;\n" +
			"quantized weights must split on group (and, for int4, 8-wide packing) boundaries.\n" +
			"`qtool verify --tp N DIR` runs the result.",
		Flags: []cli.Flag{
			&cli.IntFlag{Name: "tp", Usage: "number of ranks `N`", Required: true},
			&cli.StringFlag{Name: "output", Aliases: []string{"o"}, Usage: "output directory `DIR`", TakesFile: true},
			&cli.BoolFlag{Name: "check", Usage: "only check that MODEL can be split over N ranks; write nothing"},
			&cli.BoolFlag{Name: "force", Usage: "replace DIR when it already holds a model (the old one is removed entirely)"},
			&cli.BoolFlag{Name: "quiet", Aliases: []string{"q"}, Usage: "print only the written manifest (or the check result)"},
		},
		Action: runShard,
	}
}

// shardArgs accepts MODEL with -o/--output given before it, or after it
// ("MODEL -o DIR"), since flags after positional arguments are not parsed
// by the CLI library.
func shardArgs(c *cli.Context) (in, out string, err error) {
	args := c.Args().Slice()
	out = c.String("output")
	if len(args) == 3 && (args[1] == "-o" || args[1] == "--output") {
		if out != "" {
			return "", "", errors.New("shard: -o given twice")
		}
		args, out = args[:1], args[2]
	} else if len(args) == 2 {
		for _, p := range []string{"-o=", "--output="} {
			if v, ok := strings.CutPrefix(args[1], p); ok && out == "" {
				args, out = args[:1], v
			}
		}
	}
	if len(args) != 1 {
		return "", "", fmt.Errorf("shard: want exactly one MODEL argument, got %q (usage: qtool shard --tp N MODEL -o DIR)", args)
	}
	if out == "" && !c.Bool("check") {
		return "", "", errors.New("shard: no output directory: give -o DIR (or --check)")
	}
	return args[0], out, nil
}

func runShard(c *cli.Context) error {
	in, out, err := shardArgs(c)
	if err != nil {
		return err
	}
	stdout := c.App.Writer
	if stdout == nil {
		stdout = os.Stdout
	}
	n := c.Int("tp")
	if n < 1 {
		return fmt.Errorf("shard: --tp %d: want at least 1", n)
	}
	m, err := convert.Open(in)
	if err != nil {
		return fmt.Errorf("shard: %w", err)
	}
	defer m.Close()
	var man *shard.Manifest
	if c.Bool("check") {
		man, err = shard.Plan(m, n)
	} else {
		man, err = shard.WriteWith(m, n, out, shard.WriteOptions{Force: c.Bool("force")})
	}
	if err != nil {
		return fmt.Errorf("shard: %w", err)
	}
	w := stdout // the result line; stdout the details, which --quiet drops
	if c.Bool("quiet") {
		stdout = io.Discard
	}
	counts := map[shard.Split]int{}
	for _, e := range man.Tensors {
		counts[e.Split]++
	}
	fmt.Fprintf(stdout, "model   %s (%s, %s, %d heads, %d KV heads)\n", in, m.Format, m.Config.Arch, m.Config.Heads, m.Config.KVHeads)
	fmt.Fprintf(stdout, "split   tp %d: %d column-parallel, %d row-parallel, %d vocab-parallel, %d replicated tensors\n",
		n, counts[shard.Column], counts[shard.Row], counts[shard.Vocab], counts[shard.Replicated])
	if c.Bool("check") {
		fmt.Fprintf(w, "check   ok (nothing written)\n")
		return nil
	}
	for r, f := range man.Files {
		size := int64(0)
		if fi, err := os.Stat(filepath.Join(out, f)); err == nil {
			size = fi.Size()
		}
		fmt.Fprintf(stdout, "rank %-3d %s (%.1f MiB)\n", r, filepath.Join(out, f), float64(size)/(1<<20))
	}
	fmt.Fprintf(w, "wrote   %s\n", filepath.Join(out, shard.ManifestFile))
	return nil
}
