package calib

import (
	"fmt"

	"qtool/formats/model"
	"qtool/runtime"
)

// floatRef carries the float model's path through the layers beside the
// quantized one (TrackFloat): its own residual stream, advanced through each
// layer with the float weights the layer held when the session reached it,
// by the runtime's blocks (AttnNorm, Attention, Project, MLPNorm, MLPHidden
// with float overrides), so the float path is inference's arithmetic too.
type floatRef struct {
	x    runtime.Buf       // float residual stream entering the current layer
	mid  runtime.Buf       // float residual after the attention block
	in   runtime.Buf       // float input of the current capture point
	ov   runtime.Overrides // the current layer's float linears
	bufs []runtime.Buf     // the buffers behind ov
	// res and qres are the float and the quantized residual streams the
	// output of the current group is added to (o, down; nil otherwise).
	res, qres runtime.Buf
	at        runtime.CapturePoint
	layer     int
}

// TrackFloat makes the session carry the float model beside the quantized
// one: a second residual stream that goes through every layer with the
// weights the layer held before the quantizer changed any of them. During a
// step, FloatInput is the float model's input of the same linear group and
// FloatResidual the two residual streams the group's output joins, so that
// a quantizer can aim at the float model's outputs rather than at its
// weights on the quantized inputs (asymmetric calibration); after Run,
// FloatStream is the float model's final hidden state. Call it before Run
// (after SetCheckpoint when resuming: the checkpoint then holds the float
// stream too). It costs a second forward pass and two residual buffers.
func (s *Session) TrackFloat() error {
	if s.ref != nil {
		return nil
	}
	x := s.be.Alloc(s.x.Rows(), s.x.Cols())
	switch {
	case s.floatResumed != nil:
		s.be.Upload(x, s.floatResumed)
		s.floatResumed = nil
	case s.start > 0:
		s.be.Free(x)
		return fmt.Errorf("calibration: resuming after layer %d: the checkpoint holds no float stream (it was written by a run without one)", s.start)
	default:
		s.be.CopyRows(x, 0, s.x, 0, s.x.Rows())
	}
	s.ref = &floatRef{x: x, layer: -1}
	return nil
}

// FloatInput returns, during a step of a session that tracks the float
// model (TrackFloat), the float model's input of the step's linear group
// ([Rows, in], owned by the session, valid during the step); nil otherwise.
func (s *Session) FloatInput() runtime.Buf {
	if s.ref == nil {
		return nil
	}
	return s.ref.in
}

// FloatResidual returns, during the o and down steps of a session that
// tracks the float model, the residual streams the group's output is added
// to: the float model's and the quantized model's ([Rows, hidden], owned by
// the session, valid during the step). It returns nils at q/k/v and
// gate/up, and without TrackFloat.
func (s *Session) FloatResidual() (float, quant runtime.Buf) {
	if s.ref == nil {
		return nil, nil
	}
	return s.ref.res, s.ref.qres
}

// FloatStream returns the float model's residual stream entering the layer
// Run reaches next (after the last layer, its final hidden states; compare
// Residual), or nil without TrackFloat. It is owned by the session.
func (s *Session) FloatStream() runtime.Buf {
	if s.ref == nil {
		return nil
	}
	return s.ref.x
}

// FloatErrOf returns ‖x·Ŵᵀ − xf·Wᵀ‖² / ‖xf·Wᵀ‖² during a step of a session
// that tracks the float model: x the step's input, xf the float model's
// (FloatInput), Ŵ the installed linear (l, r) and w its float weight (on
// the backend) before quantization. It is the module's error against the
// float model's output, the errors of earlier layers included, on at most
// maxRows evenly strided rows; 0 without TrackFloat.
func (s *Session) FloatErrOf(x, w runtime.Buf, l int, r model.Role, maxRows int) float64 {
	if s.FloatInput() == nil {
		return 0
	}
	return s.OutputErr(x, s.RT.Linear(l, r), s.FloatInput(), w, maxRows)
}

// startLayer keeps the float weights of layer l as it is loaded.
func (r *floatRef) startLayer(s *Session, l int) {
	be := s.be
	r.ov, r.layer = runtime.Overrides{}, l
	for _, role := range []model.Role{model.Q, model.K, model.V, model.O, model.Gate, model.Up, model.Down} {
		b := be.Dequantize(s.RT.Linear(l, role))
		r.bufs = append(r.bufs, b)
		r.ov[role] = be.FloatLinear(b)
	}
}

// capture computes the float model's input of group p of the current layer
// from where the previous capture left it; qres is the quantized residual
// stream the group's output joins (o, down). A nil r does nothing.
func (r *floatRef) capture(s *Session, l int, p runtime.CapturePoint, qres runtime.Buf) {
	if r == nil {
		return
	}
	be, rt := s.be, s.RT
	r.res, r.qres, r.at = nil, nil, p
	switch p {
	case runtime.CaptureQKV:
		r.setIn(be, rt.AttnNorm(l, r.x))
	case runtime.CaptureO:
		// from the float path's own attn_norm output: the q/k/v step may
		// have changed the installed norm (AWQ, SmoothQuant)
		r.setIn(be, s.attention(l, r.in, r.ov))
		r.res, r.qres = r.x, qres
	case runtime.CaptureGateUp:
		r.mid = be.Alloc(r.x.Rows(), r.x.Cols())
		rt.Project(l, model.O, r.mid, r.in, r.ov)
		be.Add(r.mid, r.x)
		r.setIn(be, rt.MLPNorm(l, r.mid))
	case runtime.CaptureDown:
		r.setIn(be, rt.MLPHidden(l, r.in, r.ov))
		r.res, r.qres = r.mid, qres
	}
}

func (r *floatRef) setIn(be runtime.Calibrator, b runtime.Buf) {
	if r.in != nil {
		be.Free(r.in)
	}
	r.in = b
}

// endLayer advances the float residual stream through the layer's down
// projection (when the layer got that far) and releases the layer's
// buffers.
func (r *floatRef) endLayer(s *Session) {
	be := s.be
	if r.at == runtime.CaptureDown && r.mid != nil && r.in != nil {
		o := be.Alloc(r.x.Rows(), r.x.Cols())
		s.RT.Project(r.layer, model.Down, o, r.in, r.ov)
		be.Add(r.mid, o)
		be.Free(o)
		be.Free(r.x)
		r.x, r.mid = r.mid, nil
	}
	r.setIn(be, nil)
	if r.mid != nil {
		be.Free(r.mid)
		r.mid = nil
	}
	for _, l := range r.ov {
		be.FreeLinear(l)
	}
	for _, b := range r.bufs {
		be.Free(b)
	}
	r.ov, r.bufs, r.res, r.qres = nil, nil, nil, nil
	r.at = runtime.CaptureQKV
}

// close releases every buffer (a nil r does nothing).
func (r *floatRef) close(be runtime.Calibrator) {
	if r == nil {
		return
	}
	r.setIn(be, nil)
	for _, b := range []runtime.Buf{r.x, r.mid} {
		if b != nil {
			be.Free(b)
		}
	}
	for _, l := range r.ov {
		be.FreeLinear(l)
	}
	for _, b := range r.bufs {
		be.Free(b)
	}
}
