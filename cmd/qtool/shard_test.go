package main

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"

	"qtool/formats/shard"
)

// runShardCmd runs `qtool shard ARGS` on an app holding only the shard
// command (so the test does not depend on main.go's command list).
func runShardCmd(args ...string) (string, error) {
	var out bytes.Buffer
	app := &cli.App{Name: "qtool", Commands: []*cli.Command{shardCommand()}, Writer: &out, ErrWriter: &out}
	err := app.Run(append([]string{"qtool", "shard"}, args...))
	return out.String(), err
}

func TestShardCommand(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tp2")
	for _, c := range []struct {
		name string
		args []string
		want string // in the output, or in the error when wantErr
		err  bool
	}{
		{"flag after model", []string{"--tp", "2", llamaMini, "-o", dir}, "rank 1", false},
		{"existing manifest", []string{"--tp", "2", "-o", dir, llamaMini}, "--force replaces it", true},
		{"force", []string{"--tp", "2", "--force", "-o", dir, llamaMini}, "20 column-parallel, 8 row-parallel, 2 vocab-parallel, 9 replicated", false},
		{"bad tp", []string{"--tp", "3", "--check", llamaMini}, "sizes that work: 1, 2", true},
		{"check", []string{"--tp", "2", "--check", llamaMini}, "check   ok", false},
		{"no output", []string{"--tp", "2", llamaMini}, "give -o DIR", true},
		{"two models", []string{"--tp", "2", "-o", dir, llamaMini, llamaMini}, "exactly one MODEL", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			out, err := runShardCmd(c.args...)
			if c.err {
				if err == nil || !strings.Contains(err.Error(), c.want) {
					t.Fatalf("err = %v, want %q\n%s", err, c.want, out)
				}
				return
			}
			if err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			if !strings.Contains(out, c.want) {
				t.Fatalf("output lacks %q:\n%s", c.want, out)
			}
		})
	}
	ranks, man, err := shard.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range ranks {
		r.Close()
	}
	if man.WorldSize != 2 || len(ranks) != 2 {
		t.Fatalf("world size %d, %d ranks", man.WorldSize, len(ranks))
	}
}
