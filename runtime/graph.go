package runtime

import "errors"

// ErrNoCapture is returned by DecodeGrapher.BeginCapture when the backend
// cannot capture a decode step as a whole (e.g. a tensor-parallel backend
// whose ranks are not GPUs).
var ErrNoCapture = errors.New("the backend cannot capture decode steps")

// DecodeGrapher is implemented by backends that can capture one greedy
// single-token decode step into a graph (the CUDA backend, and the
// tensor-parallel backend over CUDA ranks). A replay embeds the token held
// on the device at the position held on the device, runs the layers and the
// classifier, records the argmax in a history, feeds it to the next replay
// and advances the position: a whole greedy step with no host round trip.
//
// The protocol: run one single-token step uncaptured first (so that every
// buffer the step needs exists), then BeginCapture(pos, maxHist), one
// single-token step through the model (Embed of one id, the layers, the
// logits) at position pos, GreedyAdvance(logits), Free(logits) and
// EndCapture. SetDecodeState sets the token and position of the next
// replay; History reads the tokens the replays produced.
type DecodeGrapher interface {
	// BeginCapture starts capturing a step at position pos; maxHist bounds
	// the positions whose tokens History can return.
	BeginCapture(pos, maxHist int) error
	// GreedyAdvance (inside a capture) takes the argmax of the single row
	// of logits as the next token.
	GreedyAdvance(logits Buf)
	// EndCapture finishes the capture.
	EndCapture() (DecodeGraph, error)
	// SetDecodeState sets the token the next replay embeds and its position.
	SetDecodeState(id, pos int)
	// History returns the tokens the replays recorded at positions
	// [from, to); it waits for the queued replays.
	History(from, to int) []int
}

// DecodeGraph is a captured decode step.
type DecodeGraph interface {
	// Launch queues one replay.
	Launch()
	// Destroy releases the graph once its replays have finished.
	Destroy()
}
