package main

import (
	"errors"

	"github.com/urfave/cli/v2"
)

// PLACEHOLDER: replaced by the owner of this command.
func awqCommand() *cli.Command {
	return &cli.Command{Name: "awq", Action: func(*cli.Context) error { return errors.New("awq: not built yet") }}
}
