package main

import (
	"errors"

	"github.com/urfave/cli/v2"
)

// PLACEHOLDER: replaced by the owner of this command.
func inspectCommand() *cli.Command {
	return &cli.Command{Name: "inspect", Action: func(*cli.Context) error { return errors.New("inspect: not built yet") }}
}
