package main

import (
	"fmt"
	"math"

	"github.com/urfave/cli/v2"
)

// intFloors are the smallest values of the integer options shared by
// several commands (what 0 means is in each flag's usage).
var intFloors = map[string]int{
	"threads": 0, "max-chunks": 0, "max-new": 0, "top-k": 0, "verify-chunks": 0, "seq-len": 0,
	"block": 1, "search-tokens": 1,
}

// checkFlags rejects out-of-range numeric options before a command runs,
// naming the option and the range: a negative count is a mistake, not
// "all" or "none".
func checkFlags(c *cli.Context) error {
	name := c.Command.Name
	for _, f := range c.Command.Flags {
		flag := f.Names()[0]
		if !c.IsSet(flag) {
			continue
		}
		if floor, ok := intFloors[flag]; ok {
			if v := c.Int(flag); v < floor {
				return fmt.Errorf("%s: --%s %d: want at least %d", name, flag, v, floor)
			}
		}
		switch flag {
		case "temperature":
			if v := c.Float64(flag); !(v >= 0) || math.IsInf(v, 0) {
				return fmt.Errorf("%s: --temperature %g: want a finite value >= 0 (0: greedy)", name, v)
			}
		case "top-p":
			if v := c.Float64(flag); !(v >= 0 && v <= 1) {
				return fmt.Errorf("%s: --top-p %g: want a probability in 0..1", name, v)
			}
		}
	}
	return nil
}

// withFlagChecks runs checkFlags before each command of cmds.
func withFlagChecks(cmds []*cli.Command) []*cli.Command {
	for _, c := range cmds {
		if c.Before == nil {
			c.Before = checkFlags
		}
	}
	return cmds
}
