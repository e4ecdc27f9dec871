package tp

import (
	"errors"
	"fmt"

	"qtool/runtime"
)

// The tensor-parallel backend captures a decode step as one graph per
// local rank: each rank captures its kernels and its collectives (NCCL
// calls are captured like kernels) on its own stream, from its own thread,
// and a replay launches every rank's graph. The logits are all-gathered
// inside the step, every rank takes the same argmax and feeds it to its
// next replay, so the ranks stay in step without the host.

var _ runtime.DecodeGrapher = (*Backend)(nil)

// graphers returns the local ranks as DecodeGraphers, or ErrNoCapture when
// a step cannot be captured: ranks that are not GPUs, or collectives
// through host memory.
func (b *Backend) graphers() ([]runtime.DecodeGrapher, error) {
	if b.dcomm == nil {
		return nil, fmt.Errorf("tp: collectives through host memory: %w", runtime.ErrNoCapture)
	}
	gs := make([]runtime.DecodeGrapher, len(b.ranks))
	for _, r := range b.local {
		g, ok := b.ranks[r].(runtime.DecodeGrapher)
		if !ok {
			return nil, fmt.Errorf("tp: rank %d (%s): %w", r, b.ranks[r].Name(), runtime.ErrNoCapture)
		}
		gs[r] = g
	}
	return gs, nil
}

// BeginCapture implements runtime.DecodeGrapher: every local rank starts
// capturing on its stream.
func (b *Backend) BeginCapture(pos, maxHist int) error {
	gs, err := b.graphers()
	if err != nil {
		return err
	}
	errs := make([]error, len(b.ranks))
	b.each(func(r int) { errs[r] = gs[r].BeginCapture(pos, maxHist) })
	if err := errors.Join(errs...); err != nil {
		b.each(func(r int) { // end the captures that began
			if errs[r] == nil {
				if g, e := gs[r].EndCapture(); e == nil {
					g.Destroy()
				}
			}
		})
		return fmt.Errorf("tp: begin capture: %w", err)
	}
	return nil
}

// GreedyAdvance implements runtime.DecodeGrapher: the vocabulary-split
// logits are all-gathered and every rank advances on the whole row.
func (b *Backend) GreedyAdvance(logits runtime.Buf) {
	gs, err := b.graphers()
	if err != nil {
		panic(fmt.Sprintf("tp.GreedyAdvance: %v", err))
	}
	l := bufOf(logits)
	b.replicate(l)
	b.each(func(r int) { gs[r].GreedyAdvance(l.parts[r]) })
}

// EndCapture implements runtime.DecodeGrapher.
func (b *Backend) EndCapture() (runtime.DecodeGraph, error) {
	gs, err := b.graphers()
	if err != nil {
		return nil, err
	}
	g := &graph{b: b, parts: make([]runtime.DecodeGraph, len(b.ranks))}
	errs := make([]error, len(b.ranks))
	b.each(func(r int) { g.parts[r], errs[r] = gs[r].EndCapture() })
	if err := errors.Join(errs...); err != nil {
		g.Destroy()
		return nil, fmt.Errorf("tp: end capture: %w", err)
	}
	return g, nil
}

// SetDecodeState implements runtime.DecodeGrapher on every local rank.
func (b *Backend) SetDecodeState(id, pos int) {
	gs, err := b.graphers()
	if err != nil {
		panic(fmt.Sprintf("tp.SetDecodeState: %v", err))
	}
	b.each(func(r int) { gs[r].SetDecodeState(id, pos) })
}

// History implements runtime.DecodeGrapher: the first local rank's (every
// rank records the same tokens).
func (b *Backend) History(from, to int) []int {
	gs, err := b.graphers()
	if err != nil {
		panic(fmt.Sprintf("tp.History: %v", err))
	}
	return gs[b.local[0]].History(from, to)
}

// graph is a captured tensor-parallel decode step: one graph per local rank.
type graph struct {
	b     *Backend
	parts []runtime.DecodeGraph
}

// Launch implements runtime.DecodeGraph: every local rank queues its replay.
func (g *graph) Launch() { g.b.each(func(r int) { g.parts[r].Launch() }) }

// Destroy implements runtime.DecodeGraph.
func (g *graph) Destroy() {
	g.b.each(func(r int) {
		if g.parts[r] != nil {
			g.parts[r].Destroy()
			g.parts[r] = nil
		}
	})
}
