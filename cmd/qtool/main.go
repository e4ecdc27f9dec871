// Command qtool converts and quantizes LLaMA/Qwen checkpoints offline and
// proves the result by running it. See README.md or `qtool help`.
package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/urfave/cli/v2"
)

func newApp() *cli.App {
	return &cli.App{
		Name:  "qtool",
		Usage: "convert, quantize and verify LLaMA/Qwen checkpoints",
		Description: "qtool reads Hugging Face checkpoints (float, AutoAWQ, GPTQ), msmodelslim directories and\n" +
			"Kuiper/llama2.c files, quantizes them (RTN with `qtool quantize`, GPTQ, AWQ, SmoothQuant) and writes any of these\n" +
			"formats. `qtool verify` runs a model in the bundled runtime (CPU, or CUDA when present).",
		Commands: withFlagChecks([]*cli.Command{
			exportCommand(),
			inspectCommand(),
			verifyCommand(),
			gptqCommand(),
			awqCommand(),
			smoothquantCommand(),
			quantizeCommand(),
			benchCommand(),
			shardCommand(),
			convertCommand(),
			reportCommand(),
		}),
		EnableBashCompletion: true,
	}
}

func main() {
	if err := newApp().Run(os.Args); err != nil {
		var ee exitError
		if errors.As(err, &ee) { // already reported (a rank process's own message)
			os.Exit(ee.code)
		}
		fmt.Fprintln(os.Stderr, "qtool:", err)
		os.Exit(1)
	}
}
