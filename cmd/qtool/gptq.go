package main

import (
	"errors"

	"github.com/urfave/cli/v2"
)

// PLACEHOLDER: replaced by the owner of this command.
func gptqCommand() *cli.Command {
	return &cli.Command{Name: "gptq", Action: func(*cli.Context) error { return errors.New("gptq: not built yet") }}
}
