package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/x448/float16"

	"qtool/formats/model"
	"qtool/runtime"
)

// TestOwnRows checks the rows the ranks own: consecutive, covering the
// matrix, at multiples of 128 rows, each rank at least one tile where the
// tiles suffice.
func TestOwnRows(t *testing.T) {
	for _, world := range []int{2, 3, 8} {
		for _, M := range []int{1, 128, 129, 300, 2048, 2047} {
			next := 0
			for r := range world {
				r0, r1 := ownRows(r, world, M)
				if r0 != next || r1 < r0 || (r0%128 != 0 && r0 != M) {
					t.Fatalf("world %d, M %d: rank %d owns [%d, %d) after row %d", world, M, r, r0, r1, next)
				}
				if T := (M + 127) / 128; T >= world && r1 == r0 {
					t.Errorf("world %d, M %d (%d tiles): rank %d owns no rows", world, M, T, r)
				}
				next = r1
			}
			if next != M {
				t.Errorf("world %d, M %d: the ranks own %d rows", world, M, next)
			}
		}
	}
}

// TestSeqParallelExchange checks the sequence-parallel exchange on 2 and 3
// ranks of one GPU (exchange_peer's two forms, exchangeFormOn) against the
// all-reduce it replaces, bit for bit: every
// rank's product scattering its tiles (launchTiles with scatter) and
// ExchangeNorm give the owned rows of the residual plus the partials in
// rank order (the product added on rank 0, then AllReducePeer) and, in
// every rank's gather area, their RMSNorm in fp16 (RMSNorm, rounded);
// ProductsGathered from it gives MatMul's products of the normed rows;
// GatherOwned makes the residual whole; ExchangeSum and GatherOwned (how
// runtime/tp settles a buffer) give the all-reduce's sums. Two rounds, so
// that both stages serve. Hopper only (the GEMMs that send).
func TestSeqParallelExchange(t *testing.T) {
	const (
		M, K, eps = 300, 256, 1e-5 // 3 tiles, the last of 44 rows
	)
	for _, world := range []int{2, 3} {
		ranks := peerGroup(t, world, 1<<21, time.Minute)
		if !ranks[0].wgmma {
			t.Skip("no Hopper GEMMs (wgmma) on this GPU: nothing sends its tiles")
		}
		// ranks of one GPU: the first form whose grids all fit (on an H200
		// exchange_peer for two, exchange_peer_shared for three: the suite
		// launches both)
		fits := func(k string) bool {
			return world*ranks[0].peer.lanes[1].blocks <= ranks[0].residentBlocks(k, 0)*ranks[0].sms
		}
		want := "exchange_peer_shared"
		if fits("exchange_peer") {
			want = "exchange_peer"
		}
		if got := ranks[0].peer.exchange; got != (exchangeForm{want, 0}) || !fits(got.kernel) {
			t.Fatalf("%d ranks of one GPU: exchange form %+v, want %q unpadded (the first that fits)", world, got, want)
		}
		t.Logf("%d ranks of one GPU: %s", world, want)
		// a rank alone on its GPU (gputest's ranks launch it): exchange_peer
		// padded to one block a multiprocessor
		if f := ranks[0].exchangeFormOn(1); f.kernel != "exchange_peer" || f.shm == 0 || ranks[0].residentBlocks(f.kernel, f.shm) != 1 {
			t.Fatalf("a rank alone on its GPU: exchange form %+v, want exchange_peer padded to one block a multiprocessor", f)
		}
		r := rand.New(rand.NewPCG(uint64(world), 31))
		// N = 512: a row in registers; 5120: rows of two chunks (a 13B's width)
		for _, tc := range []struct {
			wc string
			N  int
		}{{"f16", 512}, {"bf16", 512}, {"awq-int4-asym-g128", 512}, {"w8-g128-offset", 512}, {"bf16", 5120}, {"awq-int4-asym-g128", 5120}} {
			wc, N := tc.wc, tc.N
			c := weightCaseNamed(t, wc)
			t.Run(fmt.Sprintf("world=%d/%s/N=%d", world, wc, N), func(t *testing.T) {
				ws, nexts := make([]runtime.Linear, world), make([]runtime.Linear, world)
				xs, norms := make([]*Buf, world), make([]runtime.Vector, world)
				nw := randVec(r, N, 1)
				for q, b := range ranks {
					ws[q] = uploadWeights(t, b, r, c, fmt.Sprintf("sp.%s.%d.r%d.", wc, N, q), []int{N}, K)[0]
					same := rand.New(rand.NewPCG(uint64(world), 37)) // every rank's products of the gathered rows the same
					nexts[q] = uploadWeights(t, b, same, c, fmt.Sprintf("sp.next.%s.%d.r%d.", wc, N, q), []int{K}, N)[0]
					xs[q] = upload(b, M, K, randVec(r, M*K, 1))
					var err error
					if norms[q], err = b.UploadVector("sp.norm", model.FromFloat32([]int{N}, nw)); err != nil {
						t.Fatal(err)
					}
				}
				defer func() {
					for q, b := range ranks {
						b.Sync()
						b.Free(xs[q])
						b.FreeLinear(ws[q])
						b.FreeLinear(nexts[q])
						b.FreeVector(norms[q])
					}
				}()
				if !ranks[0].CanScatter(ws[0], M) || !ranks[0].CanGather([]runtime.Linear{nexts[0]}, M) {
					t.Fatalf("CanScatter %v, CanGather %v: want both", ranks[0].CanScatter(ws[0], M), ranks[0].CanGather([]runtime.Linear{nexts[0]}, M))
				}
				for round := range 2 {
					resid := randVec(r, M*N, 1)
					want, got, settled := make([]*Buf, world), make([]*Buf, world), make([]*Buf, world)
					for q, b := range ranks {
						want[q], got[q], settled[q] = upload(b, M, N, resid), upload(b, M, N, resid), upload(b, M, N, resid)
						product(b, q, want[q], xs[q], ws[q])
					}
					syncAll(ranks)
					for q, b := range ranks {
						b.AllReducePeer(want[q])
					}
					sums := download(ranks[0], want[0])
					// the reference's norm and the next product from it
					h, next := ranks[0].Alloc(M, N), ranks[0].Alloc(M, K)
					ranks[0].RMSNorm(h, want[0], norms[0], nil, eps)
					ranks[0].MatMul(next, h, nexts[0])
					normed, wantNext := download(ranks[0], h), download(ranks[0], next)
					ranks[0].Free(h)
					ranks[0].Free(next)

					scatter := func(d []*Buf) {
						for q, b := range ranks {
							ts := b.scatterer(lin(ws[q]), M)
							if ts.kernel == "" {
								t.Fatalf("rank %d: no scattering GEMM after CanScatter", q)
							}
							func() {
								defer b.enter()()
								b.launchTiles(ts, d[q], &gemmIn{x: xs[q]}, lin(ws[q]), false, true)
							}()
						}
						syncAll(ranks) // every rank's GEMM done before any exchange waits
					}
					scatter(got)
					for q, b := range ranks {
						b.ExchangeNorm(got[q], norms[q], nil, eps)
					}
					syncAll(ranks)
					for q, b := range ranks {
						r0, r1 := ownRows(q, world, M)
						g := download(b, got[q])
						for i := r0 * N; i < r1*N; i++ {
							if math.Float32bits(g[i]) != math.Float32bits(sums[i]) {
								t.Fatalf("round %d, rank %d: owned value %d (row %d) = %v, want %v", round, q, i, i/N, g[i], sums[i])
							}
						}
						var hs []uint16
						func() { // the rank's context current on this thread (ranks' goroutines share threads)
							defer b.enter()()
							hs = downloadAs[uint16](b, b.peer.area+b.peer.gatherOff, M*N)
						}()
						for i, v := range hs {
							if w := float16.Fromfloat32(normed[i]).Bits(); v != w {
								t.Fatalf("round %d, rank %d: gathered value %d (row %d) = %#04x, want %#04x (%v)", round, q, i, i/N, v, w, normed[i])
							}
						}
						next := b.Alloc(M, K)
						b.ProductsGathered([]runtime.Buf{next}, []runtime.Linear{nexts[q]})
						if g := download(b, next); !slices.Equal(g, wantNext) {
							t.Errorf("round %d, rank %d: ProductsGathered differs from MatMul of the normed rows (first values %v vs %v)", round, q, g[:4], wantNext[:4])
						}
						b.Free(next)
					}
					for q, b := range ranks {
						b.GatherOwned(got[q])
					}
					scatter(settled)
					for q, b := range ranks {
						b.ExchangeSum(settled[q])
					}
					syncAll(ranks)
					for q, b := range ranks {
						b.GatherOwned(settled[q])
					}
					for q, b := range ranks {
						if g := download(b, got[q]); !slices.Equal(g, sums) {
							t.Errorf("round %d, rank %d: ExchangeNorm then GatherOwned differs from the all-reduce", round, q)
						}
						if g := download(b, settled[q]); !slices.Equal(g, sums) {
							t.Errorf("round %d, rank %d: ExchangeSum then GatherOwned differs from the all-reduce", round, q)
						}
						b.Free(want[q])
						b.Free(got[q])
						b.Free(settled[q])
					}
				}
			})
		}
	}
}
