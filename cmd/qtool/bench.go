package main

import (
	"errors"

	"github.com/urfave/cli/v2"
)

// PLACEHOLDER: replaced by the owner of this command.
func benchCommand() *cli.Command {
	return &cli.Command{Name: "bench", Action: func(*cli.Context) error { return errors.New("bench: not built yet") }}
}
