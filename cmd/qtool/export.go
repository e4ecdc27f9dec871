package main

import (
	"errors"

	"github.com/urfave/cli/v2"
)

// PLACEHOLDER: replaced by the owner of this command.
func exportCommand() *cli.Command {
	return &cli.Command{Name: "export", Action: func(*cli.Context) error { return errors.New("export: not built yet") }}
}
