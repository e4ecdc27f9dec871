package cuda

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"qtool/formats/model"
	"qtool/runtime"
)

// peerGroup makes world backends of the first GPU (one stream each) a
// peer-memory group, as ranks 0..world−1 of one process on one device are.
func peerGroup(t *testing.T, world, capFloats int, timeout time.Duration) []*Backend {
	t.Helper()
	return peerGroupOn(t, make([]int, world), capFloats, timeout)
}

// peerGroupOn is peerGroup with rank r on GPU devices[r]; it skips the test
// where GPUs of the group cannot reach each other's memory.
func peerGroupOn(t *testing.T, devices []int, capFloats int, timeout time.Duration) []*Backend {
	t.Helper()
	world := len(devices)
	ranks := make([]*Backend, world)
	ends := make([][]byte, world)
	for r := range ranks {
		ranks[r] = newTestDevice(t, devices[r])
		var err error
		if ends[r], err = ranks[r].OpenPeerReduce(r, world, capFloats, timeout); err != nil {
			t.Fatal(err)
		}
		if len(ends[r]) != peerEndBytes {
			t.Fatalf("end of %d bytes, want %d", len(ends[r]), peerEndBytes)
		}
	}
	for r := range ranks {
		if err := ranks[r].ConnectPeerReduce(ends); err != nil {
			if slices.ContainsFunc(devices, func(d int) bool { return d != devices[r] }) {
				t.Skipf("rank %d on GPU %d: %v (no peer access between the GPUs)", r, devices[r], err)
			}
			t.Fatal(err)
		}
		if got := ranks[r].peerReduceCap(); got != capFloats {
			t.Fatalf("peerReduceCap = %d, want %d", got, capFloats)
		}
		want := 0 // by the GPUs' PCI addresses: the ranks given the same device
		for _, d := range devices {
			if d == devices[r] {
				want++
			}
		}
		if got := ranks[r].peer.onDevice; got != want {
			t.Fatalf("rank %d counts %d ranks on its GPU, want %d", r, got, want)
		}
	}
	t.Cleanup(func() { // a test that closes the group itself finds nothing left to close here
		for r, b := range ranks {
			if err := b.ClosePeerReduce(); err != nil {
				t.Errorf("rank %d: ClosePeerReduce: %v", r, err)
			}
		}
	})
	return ranks
}

// TestAllReducePeer sums random vectors over 2 and 3 ranks and wants, on
// every rank, the float32 sum in rank order bit for bit: sizes below one
// float4, with a scalar tail, up to the small lane's capacity and beyond,
// up to the whole capacity (every block's loop running several rounds),
// the lanes interleaved and each size twice so that both stages serve.
func TestAllReducePeer(t *testing.T) {
	const capFloats = 3*peerLargeBlocks*256*4*4 + 6
	for _, world := range []int{2, 3} {
		ranks := peerGroup(t, world, capFloats, time.Minute)
		rng := rand.New(rand.NewPCG(uint64(world), 7))
		for _, n := range []int{1, 1, 3, 4096, 65543, 4096, peerSmallFloats, capFloats, 4097, 65543,
			peerSmallFloats, capFloats, 1, peerSmallFloats + 1} {
			xs := make([][]float32, world)
			bufs := make([]*Buf, world)
			for r := range ranks {
				xs[r] = randVec(rng, n, 1)
				bufs[r] = upload(ranks[r], 1, n, xs[r])
			}
			for r := range ranks { // all queued before any download waits
				ranks[r].AllReducePeer(bufs[r])
			}
			for r := range ranks {
				got := download(ranks[r], bufs[r])
				for i := range got {
					want := xs[0][i]
					for q := 1; q < world; q++ {
						want += xs[q][i]
					}
					if math.Float32bits(got[i]) != math.Float32bits(want) {
						t.Fatalf("world %d, n %d: rank %d value %d = %v, want %v", world, n, r, i, got[i], want)
					}
				}
				checkPeerRowSums(t, ranks[r], bufs[r], got, n <= peerSmallFloats)
				ranks[r].Free(bufs[r])
			}
		}
		for _, b := range ranks {
			if err := b.ClosePeerReduce(); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestPeerTwoGPUs checks a group of one rank on each of two GPUs (skipped
// on one): each counts itself alone on its GPU (the PCI addresses differ,
// gpuID), so a sequence-parallel exchange takes exchange_peer padded to one
// block a multiprocessor, and the launch after a meeting stays early.
func TestPeerTwoGPUs(t *testing.T) {
	if n, err := DeviceCount(); err != nil || n < 2 {
		t.Skipf("a group over two GPUs needs two (%d, %v)", n, err)
	}
	for r, b := range peerGroupOn(t, []int{0, 1}, 1<<12, time.Minute) { // (it checks onDevice)
		if b.metPeers(); b.plainNext {
			t.Errorf("rank %d: the launch after a meeting would be plain", r)
		}
		if b.wgmma {
			if f := b.peer.exchange; f.kernel != "exchange_peer" || f.shm == 0 {
				t.Errorf("rank %d: exchange form %+v, want exchange_peer padded", r, f)
			}
		}
	}
}

// TestPeerGatherBits checks what runtime/tp's replicatePeer builds on:
// FillBits with −0, a rank's piece copied in (Copy2D) and AllReducePeer
// leave every non-NaN value's bits as they were, ±0, infinities and
// subnormals included, on both lanes (a row of the small lane's size and
// one above it), 2 and 3 ranks.
func TestPeerGatherBits(t *testing.T) {
	special := []float32{float32(math.Copysign(0, -1)), 0, float32(math.Inf(1)), float32(math.Inf(-1)),
		math.Float32frombits(1), -math.Float32frombits(1), math.MaxFloat32, -1.5, 2.25, 1e-40}
	for _, world := range []int{2, 3} {
		ranks := peerGroup(t, world, 2*peerSmallFloats, time.Minute)
		for _, n := range []int{32000, peerSmallFloats + 7} {
			want := make([]float32, n)
			for i := range want {
				want[i] = special[i%len(special)] * float32(1+i%3)
			}
			lo := func(r int) int { return r * n / world }
			full := make([]*Buf, world)
			for r, b := range ranks {
				piece := upload(b, 1, lo(r+1)-lo(r), want[lo(r):lo(r+1)])
				full[r] = b.AllocRaw(1, n).(*Buf)
				b.FillBits(full[r], 0x80000000)
				b.Copy2D(full[r], 0, lo(r), piece, 0, 0, 1, lo(r+1)-lo(r))
				b.Free(piece)
			}
			for r, b := range ranks { // all queued before any download waits
				b.AllReducePeer(full[r])
			}
			for r, b := range ranks {
				got := download(b, full[r])
				for i := range got {
					if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
						t.Fatalf("world %d, %d values: rank %d value %d = %g (%#x), want %g (%#x)", world, n, r, i,
							got[i], math.Float32bits(got[i]), want[i], math.Float32bits(want[i]))
					}
				}
				b.Free(full[r])
			}
		}
		for _, b := range ranks {
			if err := b.ClosePeerReduce(); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// checkPeerRowSums checks the sums of squares the all-reduce of the row
// x (its values got) left for the next normed GEMV: their parts add up to
// Σ got² where want says the small lane writes them, and there are none
// otherwise.
func checkPeerRowSums(t *testing.T, b *Backend, x *Buf, got []float32, want bool) {
	t.Helper()
	rs := b.sumsIn(x)
	if (rs.p != 0) != want {
		t.Fatalf("%d values: row sums written %v, want %v", len(got), rs.p != 0, want)
	}
	if rs.p == 0 {
		return
	}
	var sum, ref float64
	for _, v := range download(b, &Buf{p: rs.p, rows: 1, cols: rs.n}) {
		sum += float64(v)
	}
	for _, v := range got {
		ref += float64(v) * float64(v)
	}
	if math.Abs(sum-ref) > 1e-5*ref {
		t.Fatalf("%d values: the row sums' parts add up to %v, Σ x² = %v", len(got), sum, ref)
	}
}

// TestMatMulAllReduce checks the products whose GEMV sends its row to the
// all-reduce (MatMulAllReduce) against MatMul (MatMulAdd on rank 0, as the
// tensor-parallel backend runs o and down) followed by AllReducePeer: the
// same bits on every rank and the row sums of the result, for every weight
// case, over 2 and 3 ranks, with some ranks sending and the others not
// (mixed); the cases whose product is not a sending GEMV (W8A8 aside:
// the split-K GEMV; a bf16 weight of more rows than one wave of its GEMV's
// blocks) must refuse and queue nothing. Sending and plain calls
// alternate, so both stages and both ways of counting calls serve.
func TestMatMulAllReduce(t *testing.T) {
	for _, world := range []int{2, 3} {
		ranks := peerGroup(t, world, 1<<16, time.Minute)
		r := rand.New(rand.NewPCG(uint64(world), 11))
		sent := map[string]bool{}
		type shape struct {
			wc      weightCase
			N       int
			regRing bool // the 32-row GEMVs' ring in registers (Options.NoAsyncGEMV)
		}
		var shapes []shape
		for _, wc := range weightCases {
			shapes = append(shapes, shape{wc, rowsFor(ranks[0], wc, 198), false})
			switch wc.name {
			case "bf16": // 4 rows a block, at most 8 blocks a multiprocessor: several waves
				shapes = append(shapes, shape{wc, 4*8*ranks[0].sms + 6, false})
			case "awq-int4-g128-tall", "w8-g128-offset-tall", "gptq-int4-perchannel-tall", "w8-perchannel-offset-tall":
				// one wave of gemv_q4_w4h, gemv_q8_w4h and their _pc forms (two
				// blocks of 32 rows a multiprocessor), which a 4-bit weight takes
				// only so (regRing)
				shapes = append(shapes, shape{wc, 64 * ranks[0].sms, true})
			}
		}
		for _, sh := range shapes {
			wc, N := sh.wc, sh.N
			for _, b := range ranks {
				b.opt.NoAsyncGEMV = sh.regRing
			}
			K := 256
			if wc.k > 0 {
				K = wc.k
			}
			ws := make([]runtime.Linear, world)
			xs := make([]*Buf, world)
			for q, b := range ranks {
				ws[q] = uploadWeights(t, b, r, wc, fmt.Sprintf("n%d.r%d.", N, q), []int{N}, K)[0]
				xs[q] = upload(b, 1, K, randVec(r, K, 1))
				// one product alone first, so that no product below
				// allocates while an all-reduce of the group spins on
				// the GPU the ranks share (a free there waited for it
				// before scratchBuf kept outgrown areas in a group; an
				// allocation may too)
				warm := b.AllocRaw(1, N)
				b.MatMul(warm, xs[q], ws[q])
				b.Free(warm)
			}
			resid := randVec(r, N, 1)
			name, _, _ := ranks[0].gemvPlan([]gemvSeg{{l: lin(ws[0])}}, 1)
			sends := ranks[0].gemvOneWave(lin(ws[0]))
			for _, mode := range []string{"all", "mixed"} {
				t.Run(fmt.Sprintf("world=%d/%s/N=%d/%s", world, wc.name, N, mode), func(t *testing.T) {
					// every upload before any all-reduce is queued: a
					// synchronous copy would wait for a rank's all-reduce,
					// which waits for the ranks not queued yet
					want, got := make([]*Buf, world), make([]*Buf, world)
					for q, b := range ranks {
						want[q], got[q] = upload(b, 1, N, resid), upload(b, 1, N, resid)
					}
					unsent := func(q int, d *Buf) { // the product, then the all-reduce
						if q == 0 {
							ranks[q].MatMulAdd(d, xs[q], ws[q])
						} else {
							ranks[q].MatMul(d, xs[q], ws[q])
						}
						ranks[q].AllReducePeer(d)
					}
					for q := range ranks {
						unsent(q, want[q])
					}
					for q, b := range ranks {
						if mode == "mixed" && q%2 == 1 {
							unsent(q, got[q])
							continue
						}
						before := b.launches
						if ok := b.MatMulAllReduce(got[q], xs[q], ws[q], q == 0); ok != sends {
							t.Fatalf("rank %d: MatMulAllReduce = %v, want %v (%s)", q, ok, sends, name)
						} else if !ok {
							if b.launches != before {
								t.Fatalf("rank %d: a refused MatMulAllReduce launched %d kernels", q, b.launches-before)
							}
							unsent(q, got[q])
						}
					}
					for q, b := range ranks {
						g, w := download(b, got[q]), download(b, want[q])
						if !slices.Equal(g, w) {
							t.Errorf("rank %d: the sent all-reduce differs from MatMul and AllReducePeer (first values %v vs %v)", q, g[:4], w[:4])
						}
						checkPeerRowSums(t, b, got[q], g, true)
						b.Free(got[q])
						b.Free(want[q])
					}
					if sends {
						sent[name] = true
					}
				})
			}
			for q, b := range ranks {
				b.Free(xs[q])
				b.FreeLinear(ws[q])
				b.opt.NoAsyncGEMV = false
			}
		}
		for _, k := range gemvKernels {
			if k != "gemv_q4_sh" && !strings.HasSuffix(k, "_n") && !sent[k] && !t.Failed() {
				t.Errorf("world %d: no case sends from the GEMV kernel %s", world, k)
			}
		}
		for _, b := range ranks {
			if err := b.ClosePeerReduce(); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestMatMulAllReduceTiles checks a prefill's row-parallel product whose
// Hopper GEMM sends its tiles to the large all-reduce (sendTiles, then
// allreduce_peer with sent set) against the product and AllReducePeer, bit
// for bit, on 2 and 3 ranks of one GPU, with every rank sending and with
// every other rank taking the plain path (the ranks may choose
// differently): float and dequantizing GEMMs, the widened 4-bit weights,
// the epilogue's column tail, and the weights whose GEMM splits K (which do
// not send). All ranks' products are queued and finished before any
// all-reduce: on one GPU a rank's waiting all-reduce would keep another
// rank's GEMM off the multiprocessors.
func TestMatMulAllReduceTiles(t *testing.T) {
	const M = 130 // two activation tiles, the second of 2 rows
	for _, world := range []int{2, 3} {
		ranks := peerGroup(t, world, 1<<18, time.Minute)
		r := rand.New(rand.NewPCG(uint64(world), 13))
		sent := map[string]bool{}
		for _, wc := range weightCases {
			K := 256
			if wc.k > 0 {
				K = wc.k
			}
			if K > 2048 {
				continue // the huge-K GEMV cases: nothing new for a GEMM
			}
			for _, N := range []int{520, 522} { // M·N above the small lane's 64 K values; 522: the column tail
				ws := make([]runtime.Linear, world)
				xs := make([]*Buf, world)
				for q, b := range ranks {
					ws[q] = uploadWeights(t, b, r, wc, fmt.Sprintf("t%d.r%d.", N, q), []int{N}, K)[0]
					xs[q] = upload(b, M, K, randVec(r, M*K, 1))
				}
				resid := randVec(r, M*N, 1)
				tp := ranks[0].tileSender(lin(ws[0]), M).kernel
				for _, mode := range []string{"all", "mixed"} {
					t.Run(fmt.Sprintf("world=%d/%s/N=%d/%s", world, wc.name, N, mode), func(t *testing.T) {
						want, got := make([]*Buf, world), make([]*Buf, world)
						for q, b := range ranks {
							want[q], got[q] = upload(b, M, N, resid), upload(b, M, N, resid)
						}
						partial := func(q int, d *Buf) { product(ranks[q], q, d, xs[q], ws[q]) }
						for q := range ranks {
							partial(q, want[q])
						}
						syncAll(ranks)
						for q, b := range ranks {
							b.AllReducePeer(want[q])
						}
						// twice: the sent calls take both stages (e and e + 1)
						for round := range 2 {
							if round > 0 {
								for q, b := range ranks {
									b.Upload(got[q], resid)
								}
							}
							sends := make([]bool, world)
							for q, b := range ranks {
								if mode == "mixed" && q%2 == 1 {
									partial(q, got[q])
									continue
								}
								before := b.launches
								func() {
									defer b.enter()()
									sends[q] = b.sendTiles(got[q], &gemmIn{x: xs[q]}, lin(ws[q]), q == 0)
								}()
								if sends[q] != (tp != "") {
									t.Fatalf("rank %d: sendTiles = %v, tileSender %q", q, sends[q], tp)
								}
								if !sends[q] {
									if b.launches != before {
										t.Fatalf("rank %d: a refused sendTiles launched %d kernels", q, b.launches-before)
									}
									partial(q, got[q])
								}
							}
							syncAll(ranks)
							for q, b := range ranks {
								if sends[q] {
									func() {
										defer b.enter()()
										b.allReduceLarge(got[q], true)
									}()
								} else {
									b.AllReducePeer(got[q])
								}
							}
							for q, b := range ranks {
								if g, w := download(b, got[q]), download(b, want[q]); !slices.Equal(g, w) {
									t.Errorf("round %d, rank %d: the sent all-reduce differs from the product and AllReducePeer (first values %v vs %v)", round, q, g[:4], w[:4])
								}
							}
						}
						for q, b := range ranks {
							b.Free(got[q])
							b.Free(want[q])
						}
						if tp != "" {
							sent[tp] = true
						}
					})
				}
				for q, b := range ranks {
					b.Free(xs[q])
					b.FreeLinear(ws[q])
				}
			}
		}
		for _, k := range tileSendKernels {
			if ranks[0].wgmma && !sent[k] && !t.Failed() {
				t.Errorf("world %d: no case sends from %s", world, k)
			}
		}
		for _, b := range ranks {
			if err := b.ClosePeerReduce(); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestMLPAllReduce checks a prefill's MLP block with down's products sent
// to the large all-reduce (MLPAllReduce: mlpSend, then allreduce_peer with
// sent set) against NormSwiGLU, down's product and AllReducePeer, bit for
// bit, on two ranks of one GPU, for the weight kinds of the default width.
// As in TestMatMulAllReduceTiles every rank's block is queued and finished
// before any all-reduce. On Hopper at least one case must have down read the
// SwiGLU's fp16 form (no to_half of its input).
func TestMLPAllReduce(t *testing.T) {
	const (
		world = 2
		M     = 130 // two activation tiles, the second of 2 rows
		H, F  = 640, 256
	)
	ranks := peerGroup(t, world, 1<<18, time.Minute)
	r := rand.New(rand.NewPCG(7, 29))
	anyFormed := false
	for _, wc := range weightCases {
		if wc.k != 0 || wc.tall != 0 {
			continue
		}
		t.Run(wc.name, func(t *testing.T) {
			gu, down := make([][]runtime.Linear, world), make([]runtime.Linear, world)
			norm := make([]runtime.Vector, world)
			for q, b := range ranks {
				gu[q] = uploadWeights(t, b, r, wc, fmt.Sprintf("mlp.gu.r%d.", q), []int{F, F}, H)
				down[q] = uploadWeights(t, b, r, wc, fmt.Sprintf("mlp.down.r%d.", q), []int{H}, F)[0]
				var err error
				if norm[q], err = b.UploadVector("mlp.norm", model.FromFloat32([]int{H}, randVec(r, H, 1))); err != nil {
					t.Fatal(err)
				}
			}
			x := randVec(r, M*H, 1)
			want, got := make([]*Buf, world), make([]*Buf, world)
			defer func() {
				for q, b := range ranks {
					b.Sync()
					if got[q] != nil {
						b.Free(got[q])
						b.Free(want[q])
					}
					b.FreeLinear(down[q])
					for _, l := range gu[q] {
						b.FreeLinear(l)
					}
					b.FreeVector(norm[q])
				}
			}()
			for q, b := range ranks {
				want[q], got[q] = upload(b, M, H, x), upload(b, M, H, x)
			}
			requireSender(t, ranks[0], lin(down[0]), M, "mlpSend", func() bool {
				sent, _ := ranks[0].mlpSend(got[0], norm[0], nil, 1e-5, gu[0][0], gu[0][1], down[0], true)
				return sent
			})
			checkSentBlock(t, ranks, want, got, "MLPAllReduce", func(q int) {
				b := ranks[q]
				g := b.Alloc(M, F)
				b.NormSwiGLU(g, want[q], norm[q], nil, 1e-5, gu[q][0], gu[q][1])
				product(b, q, want[q], g, down[q])
				b.Free(g)
			}, func(q int) {
				sent, formed := ranks[q].mlpSend(got[q], norm[q], nil, 1e-5, gu[q][0], gu[q][1], down[q], q == 0)
				if !sent {
					t.Fatalf("rank %d: mlpSend declined where tileSender chose a sending GEMM", q)
				}
				anyFormed = anyFormed || formed
			})
		})
	}
	if ranks[0].wgmma && !anyFormed && !t.Failed() {
		t.Error("no case had down read the SwiGLU's fp16 form")
	}
}

// TestAttentionAllReduce checks a prefill's attention block with o's
// products sent to the large all-reduce (AttentionAllReduce: attentionSend,
// then allreduce_peer with sent set) against Attention, o's product and
// AllReducePeer, bit for bit, on two ranks of one GPU: o of fp16 and of
// AutoAWQ 4-bit weights, whose input the attention writes in fp16
// (attn_tc_f16_h, or _h_g in two key groups), after a prefix and with its
// query tiles split. Every rank's block is queued and finished before any
// all-reduce, as in TestMatMulAllReduceTiles.
func TestAttentionAllReduce(t *testing.T) {
	const (
		world          = 2
		M, H           = 130, 640
		heads, kvHeads = 2, 1
		hd             = 128
		K              = heads * hd // 4 K steps: o's GEMM does not split K (tileSender), as at 512 it would
	)
	ranks := peerGroup(t, world, 1<<18, time.Minute)
	defer func() {
		for _, b := range ranks {
			b.opt.KVHalf, b.opt.AttnSplit = false, 0
		}
	}()
	r := rand.New(rand.NewPCG(11, 31))
	caches := make([]runtime.KVCache, world)
	for q, b := range ranks {
		b.opt.KVHalf = true
		caches[q] = b.NewKVCache(1, 400, kvHeads*hd)
		defer b.FreeKVCache(caches[q])
	}
	for _, wc := range []string{"f16", "awq-int4-asym-g128"} {
		for _, tc := range []struct{ pos0, split int }{{0, 0}, {150, 2}} {
			t.Run(fmt.Sprintf("%s/pos0=%d/split=%d", wc, tc.pos0, tc.split), func(t *testing.T) {
				ows, qs := make([]runtime.Linear, world), make([]*Buf, world)
				x := randVec(r, M*H, 1)
				want, got := make([]*Buf, world), make([]*Buf, world)
				for q, b := range ranks {
					b.opt.AttnSplit = tc.split
					ows[q] = uploadWeights(t, b, r, weightCaseNamed(t, wc), fmt.Sprintf("o.r%d.", q), []int{H}, K)[0]
					kv := upload(b, tc.pos0+M, kvHeads*hd, randVec(r, (tc.pos0+M)*kvHeads*hd, 1))
					b.StoreKV(caches[q], 0, 0, kv, kv)
					b.Free(kv)
					qs[q] = upload(b, M, K, randVec(r, M*K, 1))
					want[q], got[q] = upload(b, M, H, x), upload(b, M, H, x)
				}
				defer func() {
					for q, b := range ranks {
						b.Sync()
						b.Free(qs[q])
						b.Free(want[q])
						b.Free(got[q])
						b.FreeLinear(ows[q])
					}
				}()
				requireSender(t, ranks[0], lin(ows[0]), M, "attentionSend", func() bool {
					return ranks[0].attentionSend(got[0], qs[0], caches[0], 0, tc.pos0, heads, kvHeads, hd, ows[0], true)
				})
				checkSentBlock(t, ranks, want, got, "AttentionAllReduce", func(q int) {
					b := ranks[q]
					a := b.Alloc(M, K)
					b.Attention(a, qs[q], caches[q], 0, tc.pos0, heads, kvHeads, hd)
					product(b, q, want[q], a, ows[q])
					b.Free(a)
				}, func(q int) {
					b := ranks[q]
					before := b.KernelLaunches()
					if !b.attentionSend(got[q], qs[q], caches[q], 0, tc.pos0, heads, kvHeads, hd, ows[q], q == 0) {
						t.Fatalf("rank %d: attentionSend declined (tileSender, attnFormOut)", q)
					}
					after := b.KernelLaunches()
					h := 0
					for _, k := range []string{"attn_tc_f16_h", "attn_tc_f16_h_g", "attn_tc_f16_h_g32"} {
						h += after[k] - before[k]
					}
					if h == 0 || after["to_half"] != before["to_half"] {
						t.Errorf("rank %d: attentionSend did not write o's input in fp16 (attn_tc_f16_h, _h_g and _h_g32 %d, to_half %d launches)", q,
							h, after["to_half"]-before["to_half"])
					}
				})
			})
		}
	}
}

// syncAll waits for every rank's stream.
func syncAll(ranks []*Backend) {
	for _, b := range ranks {
		b.Sync()
	}
}

// requireSender skips the test where no Hopper GEMM multiplies M rows by l
// and sends its tiles (tileSender), after checking that send, a block's
// sending form on b (what names it), then declines and launches nothing.
func requireSender(t *testing.T, b *Backend, l *Linear, M int, what string, send func() bool) {
	t.Helper()
	if b.tileSender(l, M).kernel != "" {
		return
	}
	before := b.launches
	if send() || b.launches != before {
		t.Fatalf("%s sent or launched %d kernels where its GEMM does not send (tileSender)", what, b.launches-before)
	}
	t.Skipf("%s: the GEMM does not send its tiles here (tileSender)", what)
}

// product queues rank q's partial product of a row-parallel weight w:
// dst += x·wᵀ on rank 0 (the residual add), dst = x·wᵀ on the others.
func product(b *Backend, q int, dst, x runtime.Buf, w runtime.Linear) {
	if q == 0 {
		b.MatMulAdd(dst, x, w)
	} else {
		b.MatMul(dst, x, w)
	}
}

// checkSentBlock compares a block whose last product sends its tiles to
// the large all-reduce with the block's sequence, bit for bit, on every
// rank: ref(q) queues rank q's sequence into want[q] (its last product
// added on rank 0, stored on the others: product), send(q) the sending
// block into got[q]; AllReducePeer sums the first, allreduce_peer with
// sent set the second. Every rank's products are finished before any
// all-reduce: on one GPU a rank's waiting all-reduce would keep another
// rank's GEMM off the multiprocessors.
func checkSentBlock(t *testing.T, ranks []*Backend, want, got []*Buf, what string, ref, send func(q int)) {
	t.Helper()
	for q := range ranks {
		ref(q)
	}
	syncAll(ranks)
	for q, b := range ranks {
		b.AllReducePeer(want[q])
	}
	for q := range ranks {
		send(q)
	}
	syncAll(ranks)
	for q, b := range ranks {
		func() {
			defer b.enter()()
			b.allReduceLarge(got[q], true)
		}()
	}
	for q, b := range ranks {
		if g, w := download(b, got[q]), download(b, want[q]); !slices.Equal(g, w) {
			t.Errorf("rank %d: %s differs from its sequence and AllReducePeer (first values %v vs %v)", q, what, g[:4], w[:4])
		}
	}
}

func TestPeerReduceErrors(t *testing.T) {
	b := newTestBackend(t)
	for _, c := range []struct{ rank, world, cap int }{{0, 1, 16}, {2, 2, 16}, {0, 9, 16}, {0, 2, 0}} {
		if _, err := b.OpenPeerReduce(c.rank, c.world, c.cap, time.Second); err == nil {
			t.Errorf("OpenPeerReduce(%d, %d, %d): no error", c.rank, c.world, c.cap)
		}
	}
	end, err := b.OpenPeerReduce(0, 2, 16, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.OpenPeerReduce(0, 2, 16, time.Second); err == nil {
		t.Error("a second OpenPeerReduce: no error")
	}
	// Each case is made from the end of the latest open: a failed connect
	// closes the area, and the test opens a new one for the next case.
	corrupt := func(e []byte) []byte {
		bad := append([]byte(nil), e...)
		bad[0] ^= 1
		return bad
	}
	for _, mk := range []func() [][]byte{
		func() [][]byte { return [][]byte{end} },
		func() [][]byte { return [][]byte{end, corrupt(end)} },
		func() [][]byte { return [][]byte{end, end[:40]} },
	} {
		ends := mk()
		if err := b.ConnectPeerReduce(ends); err == nil {
			t.Errorf("ConnectPeerReduce with %d ends: no error", len(ends))
		}
		if b.peerReduceCap() != 0 {
			t.Error("a failed connect left the backend in the group")
		}
		b.ClosePeerReduce()
		if end, err = b.OpenPeerReduce(0, 2, 16, time.Second); err != nil {
			t.Fatal(err)
		}
	}
}

// TestPlainLaunchAfterMeeting checks that on ranks that share a GPU the
// kernel after one whose blocks wait for the peers' (the large and small
// all-reduce) is launched the plain way, not early, where its blocks could
// take the slots another rank's waiting blocks need (metPeers); a rank
// alone on its GPU keeps the early launch.
func TestPlainLaunchAfterMeeting(t *testing.T) {
	ranks := peerGroup(t, 2, 1<<18, time.Minute)
	if n := ranks[0].peer.onDevice; n != 2 {
		t.Fatalf("two ranks of one GPU: onDevice %d, want 2", n)
	}
	r := rand.New(rand.NewPCG(5, 7))
	for _, n := range []int{64, 1 << 17} { // the small lane's all-reduce, the large one's
		xs := make([]*Buf, len(ranks))
		for q, b := range ranks {
			xs[q] = upload(b, 1, n, randVec(r, n, 1))
		}
		for q, b := range ranks {
			b.AllReducePeer(xs[q])
			if !b.plainNext {
				t.Errorf("%d values, rank %d: the launch after the all-reduce would be an early one", n, q)
			}
		}
		for q, b := range ranks {
			b.Add(xs[q], xs[q])
			if b.plainNext {
				t.Errorf("%d values, rank %d: still plain after the next launch", n, q)
			}
		}
		syncAll(ranks)
		for q, b := range ranks {
			b.Free(xs[q])
		}
	}
	b := ranks[0]
	b.peer.onDevice = 1 // as a rank alone on its GPU would be (no launch follows)
	b.metPeers()
	b.peer.onDevice = 2
	if b.plainNext {
		t.Error("a rank alone on its GPU: the launch after a meeting would be plain")
	}
}

// TestAllReducePeerTimeout: a rank whose peer never takes part fails (its
// kernel traps after the timeout) instead of hanging. The failure spoils the
// device context, so it runs in a child process.
func TestAllReducePeerTimeout(t *testing.T) {
	if os.Getenv("QTOOL_PEER_TIMEOUT_CHILD") == "1" {
		ranks := peerGroup(t, 2, 64, 200*time.Millisecond)
		x := upload(ranks[0], 1, 64, make([]float32, 64))
		ranks[0].AllReducePeer(x) // rank 1 never calls
		download(ranks[0], x)     // panics with the failed launch
		t.Fatal("the all-reduce without its peer returned")
	}
	newTestBackend(t) // skips without a GPU
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestAllReducePeerTimeout$", "-test.v")
	cmd.Env = append(os.Environ(), "QTOOL_PEER_TIMEOUT_CHILD=1")
	t0 := time.Now()
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("the child hung for %v", time.Since(t0))
	}
	if err == nil || !strings.Contains(string(out), "CUDA_ERROR") {
		t.Fatalf("the child did not fail with a CUDA error (%v):\n%s", err, out)
	}
	t.Logf("failed after %v: %s", time.Since(t0).Round(time.Millisecond), firstLine(string(out), "CUDA_ERROR"))
}

// firstLine returns the first line of s that contains sub.
func firstLine(s, sub string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			return strings.TrimSpace(l)
		}
	}
	return ""
}

// FuzzDecodePeerEnd: a peer-memory end (from another rank, over the job's
// communicator) decodes from any bytes into an end that encodes back to
// the same bytes, or an error; never a panic. It needs no GPU.
func FuzzDecodePeerEnd(f *testing.F) {
	e := peerEnd{host: 0x1234, pid: 77, device: 1, sms: 132, area: 0x7f0000000000, gpu: 0x1b00, ipc: true}
	e.handle.Reserved[5] = 9
	f.Add(e.encode())
	e.ipc, e.handle.Reserved[5] = false, 0
	f.Add(e.encode())
	f.Add([]byte("qtP3"))
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := decodePeerEnd(b)
		if err != nil {
			return
		}
		if got := e.encode(); !bytes.Equal(got, b) {
			t.Fatalf("end %+v encodes as %x, decoded from %x", e, got, b)
		}
	})
}
