package tp

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"qtool/runtime"
	"qtool/runtime/cpu"
)

func TestJobFromEnv(t *testing.T) {
	env := func(kv ...string) func(string) string {
		m := map[string]string{}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return func(k string) string { return m[k] }
	}
	addr := []string{"MASTER_ADDR", "10.0.0.1", "MASTER_PORT", "29500"}
	for _, tc := range []struct {
		name   string
		env    func(string) string
		ok     bool
		want   Job
		errHas string
	}{
		{name: "none", env: env()},
		{name: "world of one", env: env(append([]string{"WORLD_SIZE", "1", "RANK", "0"}, addr...)...)},
		{name: "torchrun", env: env(append([]string{"WORLD_SIZE", "4", "RANK", "3", "LOCAL_RANK", "1"}, addr...)...),
			ok: true, want: Job{World: 4, Rank: 3, LocalRank: 1, Addr: "10.0.0.1:29500"}},
		{name: "mpirun", env: env(append([]string{"OMPI_COMM_WORLD_SIZE", "2", "OMPI_COMM_WORLD_RANK", "1", "OMPI_COMM_WORLD_LOCAL_RANK", "0"}, addr...)...),
			ok: true, want: Job{World: 2, Rank: 1, LocalRank: 0, Addr: "10.0.0.1:29500"}},
		{name: "srun without local rank", env: env(append([]string{"SLURM_NTASKS", "2", "SLURM_PROCID", "1"}, addr...)...),
			ok: true, want: Job{World: 2, Rank: 1, LocalRank: 1, Addr: "10.0.0.1:29500"}},
		{name: "under torchrun", env: env(append([]string{"WORLD_SIZE", "2", "RANK", "1", "LOCAL_RANK", "1", "TORCHELASTIC_RUN_ID", "none"}, addr...)...),
			ok: true, want: Job{World: 2, Rank: 1, LocalRank: 1, Addr: "10.0.0.1:29501"}},
		{name: "port given", env: env(append([]string{"WORLD_SIZE", "2", "RANK", "1", "QTOOL_TP_PORT", "4000"}, addr...)...),
			ok: true, want: Job{World: 2, Rank: 1, LocalRank: 1, Addr: "10.0.0.1:4000"}},
		{name: "timeout", env: env(append([]string{"WORLD_SIZE", "2", "RANK", "0", "QTOOL_TP_TIMEOUT", "90s"}, addr...)...),
			ok: true, want: Job{World: 2, Rank: 0, LocalRank: 0, Addr: "10.0.0.1:29500", Timeout: 90 * time.Second}},
		{name: "rank too large", env: env(append([]string{"WORLD_SIZE", "2", "RANK", "2"}, addr...)...), errHas: "RANK=2 is not below WORLD_SIZE=2"},
		{name: "not a number", env: env(append([]string{"WORLD_SIZE", "two", "RANK", "0"}, addr...)...), errHas: `WORLD_SIZE="two"`},
		{name: "no address", env: env("WORLD_SIZE", "2", "RANK", "0"), errHas: "MASTER_ADDR and MASTER_PORT"},
		{name: "bad port", env: env("WORLD_SIZE", "2", "RANK", "0", "MASTER_ADDR", "h", "MASTER_PORT", "70000"), errHas: "MASTER_PORT"},
		{name: "bad timeout", env: env(append([]string{"WORLD_SIZE", "2", "RANK", "0", "QTOOL_TP_TIMEOUT", "soon"}, addr...)...), errHas: "QTOOL_TP_TIMEOUT"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			job, ok, err := JobFromEnv(tc.env)
			if tc.errHas != "" {
				if err == nil || !strings.Contains(err.Error(), tc.errHas) {
					t.Fatalf("err = %v, want one containing %q", err, tc.errHas)
				}
				return
			}
			if err != nil || ok != tc.ok || job != tc.want {
				t.Fatalf("JobFromEnv = %+v, %v, %v; want %+v, %v", job, ok, err, tc.want, tc.ok)
			}
			if ok { // Env round-trips
				back, ok2, err := JobFromEnv(env(strings.FieldsFunc(strings.Join(job.Env(), ","), func(r rune) bool { return r == ',' || r == '=' })...))
				if err != nil || !ok2 || back.World != job.World || back.Rank != job.Rank || back.Addr != job.Addr || back.Timeout != job.Timeout {
					t.Fatalf("Env round trip: %+v, %v, %v", back, ok2, err)
				}
			}
		})
	}
}

// freeAddr returns a loopback address with a port free at the time.
func freeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// dialAll connects n socket communicators (goroutines standing in for
// processes) and returns them by rank.
func dialAll(t *testing.T, n int, fps []string, timeout time.Duration) ([]*SocketCommunicator, []error) {
	t.Helper()
	addr := freeAddr(t)
	comms, errs := make([]*SocketCommunicator, n), make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			comms[r], errs[r] = DialJob(Job{World: n, Rank: r, LocalRank: r, Addr: addr, Timeout: timeout}, fps[r])
		}()
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, c := range comms {
			if c != nil {
				c.Close()
			}
		}
	})
	return comms, errs
}

// The socket communicator gives bit for bit what the in-process one gives.
func TestSocketCommunicatorMatchesInProcess(t *testing.T) {
	const n = 3
	comms, errs := dialAll(t, n, []string{"job", "job", "job"}, 20*time.Second)
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	ip, _ := NewInProcess(n)
	data := func(r, size int) []float32 {
		v := make([]float32, size)
		for i := range v {
			v[i] = float32(math.Sin(float64(r*1000+i))) * float32(1+i%7) / 3
		}
		return v
	}
	for _, size := range []int{0, 1, 1000, 70000} {
		want, got := make([][]float32, n), make([][]float32, n)
		wantG, gotG := make([][]float32, n), make([][]float32, n)
		var wg sync.WaitGroup
		ferr := make([]error, 2*n)
		for r := range n {
			want[r], got[r] = data(r, size), data(r, size)
			wantG[r], gotG[r] = make([]float32, n*size), make([]float32, n*size)
			wg.Add(2)
			go func() {
				defer wg.Done()
				if ferr[r] = ip.AllReduceSum(r, want[r]); ferr[r] == nil {
					ferr[r] = ip.AllGather(r, data(r, size), wantG[r])
				}
			}()
			go func() {
				defer wg.Done()
				if ferr[n+r] = comms[r].AllReduceSum(r, got[r]); ferr[n+r] == nil {
					ferr[n+r] = comms[r].AllGather(r, data(r, size), gotG[r])
				}
			}()
		}
		wg.Wait()
		for i, err := range ferr {
			if err != nil {
				t.Fatalf("size %d, call %d: %v", size, i, err)
			}
		}
		for r := range n {
			for i := range want[r] {
				if math.Float32bits(want[r][i]) != math.Float32bits(got[r][i]) {
					t.Fatalf("size %d rank %d: all-reduce [%d] = %v, in-process %v", size, r, i, got[r][i], want[r][i])
				}
			}
			for i := range wantG[r] {
				if wantG[r][i] != gotG[r][i] {
					t.Fatalf("size %d rank %d: all-gather [%d] = %v, in-process %v", size, r, i, gotG[r][i], wantG[r][i])
				}
			}
		}
	}
	// Broadcast.
	var wg sync.WaitGroup
	got := make([][]byte, n)
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var msg []byte
			if r == 0 {
				msg = []byte("nccl id")
			}
			got[r], errs[r] = comms[r].Broadcast(r, msg, 16)
		}()
	}
	wg.Wait()
	for r := range n {
		if errs[r] != nil || string(got[r]) != "nccl id" {
			t.Fatalf("broadcast rank %d: %q, %v", r, got[r], errs[r])
		}
	}
}

// Misuse ends with errors that say what happened, never a hang.
func TestSocketCommunicatorErrors(t *testing.T) {
	t.Run("another job", func(t *testing.T) {
		_, errs := dialAll(t, 2, []string{"job A", "job B"}, 10*time.Second)
		if errs[0] == nil || !strings.Contains(errs[0].Error(), "runs another job") ||
			errs[1] == nil || !strings.Contains(errs[1].Error(), "refused") {
			t.Fatalf("errors %v", errs)
		}
	})
	// Two connected ranks make different calls at once.
	for _, tc := range []struct {
		name         string
		rank1        func(c *SocketCommunicator) error
		want0, want1 string
	}{
		{name: "out of step", rank1: func(c *SocketCommunicator) error { return c.AllGather(1, make([]float32, 4), make([]float32, 8)) },
			want0: "out of step", want1: "rank 0 closed the connection"},
		{name: "length differs", rank1: func(c *SocketCommunicator) error { return c.AllReduceSum(1, make([]float32, 5)) },
			want0: "5 values where this rank has 4", want1: "rank 0 closed the connection"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			comms, errs := dialAll(t, 2, []string{"j", "j"}, 10*time.Second)
			if errs[0] != nil || errs[1] != nil {
				t.Fatal(errs)
			}
			var wg sync.WaitGroup
			wg.Add(2)
			go func() { defer wg.Done(); errs[0] = comms[0].AllReduceSum(0, make([]float32, 4)) }()
			go func() { defer wg.Done(); errs[1] = tc.rank1(comms[1]) }()
			wg.Wait()
			for r, want := range []string{tc.want0, tc.want1} {
				if errs[r] == nil || !strings.Contains(errs[r].Error(), want) {
					t.Errorf("rank %d: %v, want an error containing %q", r, errs[r], want)
				}
			}
		})
	}
	t.Run("peer exits", func(t *testing.T) {
		comms, errs := dialAll(t, 2, []string{"j", "j"}, 10*time.Second)
		if errs[0] != nil || errs[1] != nil {
			t.Fatal(errs)
		}
		comms[1].Close()
		err := comms[0].AllReduceSum(0, make([]float32, 4))
		if err == nil || !strings.Contains(err.Error(), "rank 1 closed the connection") {
			t.Fatalf("rank 0: %v", err)
		}
	})
	t.Run("silent peer", func(t *testing.T) {
		comms, errs := dialAll(t, 2, []string{"j", "j"}, 300*time.Millisecond)
		if errs[0] != nil || errs[1] != nil {
			t.Fatal(errs)
		}
		err := comms[0].AllReduceSum(0, make([]float32, 4))
		if err == nil || !strings.Contains(err.Error(), "did not answer in time") {
			t.Fatalf("rank 0: %v", err)
		}
	})
	t.Run("no rank 0", func(t *testing.T) {
		_, err := DialJob(Job{World: 2, Rank: 1, Addr: freeAddr(t), Timeout: 500 * time.Millisecond}, "j")
		if err == nil || !strings.Contains(err.Error(), "did not answer within") {
			t.Fatalf("err = %v", err)
		}
	})
}

// rankEnv names the environment variable that makes the test binary one
// rank process of TestTwoProcesses; rankOut is the file rank 0 writes.
const (
	rankEnv = "QTOOL_TP_TEST_RANK_MODEL"
	rankOut = "QTOOL_TP_TEST_RANK_OUT"
)

// rankIDs are the ids the rank processes run.
func rankIDs(vocab int) []int {
	ids := make([]int, 40)
	for i := range ids {
		ids[i] = (i*131 + 7) % vocab
	}
	return ids
}

// TestMain runs the test binary as one rank of TestTwoProcesses when the
// launcher's variables and rankEnv are set.
func TestMain(m *testing.M) {
	if name := os.Getenv(rankEnv); name != "" {
		if err := runRank(name, os.Getenv(rankOut)); err != nil {
			fmt.Fprintln(os.Stderr, "rank:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runRank is one rank process: it joins the job from the environment, runs
// the model's logits on rankIDs and a greedy generation, and rank 0 writes
// both (float32 bits, then ids) to out.
func runRank(name, out string) error {
	job, ok, err := JobFromEnv(os.Getenv)
	if err != nil || !ok {
		return fmt.Errorf("no job in the environment: %v", err)
	}
	m, err := OpenModel(filepath.Join(testdata, name))
	if err != nil {
		return err
	}
	defer m.Close()
	be, err := OpenRank(job, m, RankOptions{Fingerprint: "test " + name, Device: "cpu", Threads: 1})
	if err != nil {
		return err
	}
	defer be.Close()
	rm, err := runtime.Load(m, be)
	if err != nil {
		return err
	}
	lg := logits(rm, rankIDs(m.Config.Vocab))
	gen, err := runtime.Generate(rm, rankIDs(m.Config.Vocab)[:6], runtime.GenOptions{MaxNew: 8, EOS: []int{}})
	if err != nil {
		return err
	}
	if job.Rank != 0 {
		return nil
	}
	var buf bytes.Buffer
	binary.Write(&buf, binary.LittleEndian, lg)
	for _, id := range gen {
		binary.Write(&buf, binary.LittleEndian, int32(id))
	}
	return os.WriteFile(out, buf.Bytes(), 0o644)
}

// Two processes of one rank each (the test binary re-run as ranks, talking
// over TCP) give bit for bit the logits and the greedy tokens of the
// in-process TP=2 backend.
func TestTwoProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range models {
		t.Run(name, func(t *testing.T) {
			m := openHF(t, name)
			ids := rankIDs(m.Config.Vocab)
			inproc := tpBackend(t, m, 2)
			rm := load(t, m, inproc)
			want := logits(rm, ids)
			wantGen, err := runtime.Generate(rm, ids[:6], runtime.GenOptions{MaxNew: 8, EOS: []int{}})
			if err != nil {
				t.Fatal(err)
			}

			out := filepath.Join(t.TempDir(), "rank0.bin")
			addr := freeAddr(t)
			host, port, _ := net.SplitHostPort(addr)
			procs := make([]*exec.Cmd, 2)
			stderr := make([]bytes.Buffer, 2)
			for r := range procs {
				cmd := exec.Command(exe, "-test.run=^$")
				cmd.Env = append(os.Environ(), rankEnv+"="+name, rankOut+"="+out,
					"WORLD_SIZE=2", "RANK="+strconv.Itoa(r), "LOCAL_RANK="+strconv.Itoa(r),
					"MASTER_ADDR="+host, "MASTER_PORT="+port, "QTOOL_TP_TIMEOUT=2m")
				cmd.Stderr = &stderr[r]
				if err := cmd.Start(); err != nil {
					t.Fatal(err)
				}
				procs[r] = cmd
			}
			for r, p := range procs {
				if err := p.Wait(); err != nil {
					t.Fatalf("rank %d: %v\n%s", r, err, stderr[r].String())
				}
			}
			data, err := os.ReadFile(out)
			if err != nil {
				t.Fatal(err)
			}
			if len(data) != 4*len(want)+4*len(wantGen) {
				t.Fatalf("rank 0 wrote %d bytes, want %d", len(data), 4*len(want)+4*len(wantGen))
			}
			for i, w := range want {
				if g := binary.LittleEndian.Uint32(data[4*i:]); g != math.Float32bits(w) {
					t.Fatalf("logit %d: two processes %v, one process %v", i, math.Float32frombits(g), w)
				}
			}
			for i, w := range wantGen {
				if g := int32(binary.LittleEndian.Uint32(data[4*(len(want)+i):])); int(g) != w {
					t.Fatalf("generated id %d: two processes %d, one process %d", i, g, w)
				}
			}
			t.Logf("%s: %d logits bit-identical, %d greedy ids equal", name, len(want), len(wantGen))
		})
	}
}

// A rank whose GPU does not open fails the job on every rank at once, with
// an error saying so, before any rank joins NCCL (whose initialization
// would wait for it with no time-out).
func TestRankGPUFailsEveryRank(t *testing.T) {
	m := openHF(t, "llama-mini")
	addr := freeAddr(t)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	start := time.Now()
	for r := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			opt := RankOptions{Fingerprint: "gpu fails", Device: "cuda",
				NewGPU: func(d int) (runtime.Backend, error) {
					if d == 1 {
						return nil, errors.New("no GPU here")
					}
					return fakeDevice{cpu.New(1), newMemory()}, nil
				},
				GPUs: func() (int, error) { return 2, nil }}
			be, err := OpenRank(Job{World: 2, Rank: r, LocalRank: r, Addr: addr, Timeout: time.Minute}, m, opt)
			if be != nil {
				be.Close()
			}
			errs[r] = err
		}()
	}
	wg.Wait()
	if errs[1] == nil || !strings.Contains(errs[1].Error(), "GPU 1 (LOCAL_RANK): no GPU here") {
		t.Errorf("rank 1: %v, want its GPU's error", errs[1])
	}
	if errs[0] == nil || !strings.Contains(errs[0].Error(), "1 other rank(s) could not open their GPU") {
		t.Errorf("rank 0: %v, want the other rank's failure", errs[0])
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Errorf("the ranks took %v to fail", d)
	}
}
