package tp

import (
	"fmt"
	"net"
	"strconv"
	"time"
)

// Job is where one process stands in a tensor-parallel job with a process
// per rank.
type Job struct {
	// World is the number of ranks, Rank this process's, LocalRank its
	// index among the ranks of its machine (the GPU it drives).
	World, Rank, LocalRank int
	// Addr is rank 0's host:port, where the others connect.
	Addr string
	// Timeout bounds connecting to rank 0 and every wait for the other
	// ranks; 0 means DefaultTimeout.
	Timeout time.Duration
}

// DefaultTimeout is how long a rank waits for the others by default: long
// enough for the slowest rank to load a large model between two
// collectives.
const DefaultTimeout = 10 * time.Minute

// launcherVars are the environment variables of the usual launchers, each
// group giving world size, rank and local rank.
var launcherVars = [][3]string{
	{"WORLD_SIZE", "RANK", "LOCAL_RANK"},                                           // torchrun, torch.distributed.launch
	{"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"}, // Open MPI's mpirun
	{"PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID"},                                    // MPICH / Intel MPI
	{"SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"},                              // srun
}

// JobFromEnv reads the job of a process started by a launcher: the world
// size, rank and local rank from torchrun's WORLD_SIZE, RANK and
// LOCAL_RANK (or the same from mpirun, MPICH or srun), and rank 0's
// address from MASTER_ADDR and MASTER_PORT, as torchrun sets them. Under
// torchrun (TORCHELASTIC_RUN_ID set) MASTER_PORT is taken by torchrun's own
// store, so rank 0 listens on the port after it; QTOOL_TP_PORT names
// another port. ok is false when no launcher variables are set or the
// world has one rank. QTOOL_TP_TIMEOUT (a Go duration such as "30m")
// overrides the timeout.
func JobFromEnv(getenv func(string) string) (job Job, ok bool, err error) {
	for _, vars := range launcherVars {
		if getenv(vars[0]) == "" {
			continue
		}
		var v [3]int
		for i, name := range vars {
			s := getenv(name)
			if s == "" && i == 2 {
				v[2] = -1 // no local rank: derived below
				continue
			}
			n, err := strconv.Atoi(s)
			if err != nil || n < 0 {
				return Job{}, false, fmt.Errorf("tp: environment %s=%q: want a non-negative integer", name, s)
			}
			v[i] = n
		}
		if v[0] <= 1 {
			return Job{}, false, nil
		}
		if v[1] >= v[0] {
			return Job{}, false, fmt.Errorf("tp: environment %s=%d is not below %s=%d", vars[1], v[1], vars[0], v[0])
		}
		if v[2] < 0 {
			v[2] = v[1]
		}
		job = Job{World: v[0], Rank: v[1], LocalRank: v[2]}
		host, port := getenv("MASTER_ADDR"), getenv("MASTER_PORT")
		if host == "" || port == "" {
			return Job{}, false, fmt.Errorf("tp: %s=%d but MASTER_ADDR and MASTER_PORT (rank 0's address) are not both set", vars[0], v[0])
		}
		p, err := strconv.Atoi(port)
		if err != nil || p <= 0 || p > 65535 {
			return Job{}, false, fmt.Errorf("tp: environment MASTER_PORT=%q: want a TCP port", port)
		}
		if getenv("TORCHELASTIC_RUN_ID") != "" && p < 65535 {
			p++ // torchrun's store listens on MASTER_PORT
		}
		if s := getenv("QTOOL_TP_PORT"); s != "" {
			if p, err = strconv.Atoi(s); err != nil || p <= 0 || p > 65535 {
				return Job{}, false, fmt.Errorf("tp: environment QTOOL_TP_PORT=%q: want a TCP port", s)
			}
		}
		job.Addr = net.JoinHostPort(host, strconv.Itoa(p))
		if s := getenv("QTOOL_TP_TIMEOUT"); s != "" {
			d, err := time.ParseDuration(s)
			if err != nil || d <= 0 {
				return Job{}, false, fmt.Errorf("tp: environment QTOOL_TP_TIMEOUT=%q: want a positive duration such as 30m", s)
			}
			job.Timeout = d
		}
		return job, true, nil
	}
	return Job{}, false, nil
}

// Env returns the environment variables (torchrun's) that make a process
// rank of this job.
func (j Job) Env() []string {
	host, port, _ := net.SplitHostPort(j.Addr)
	env := []string{
		"WORLD_SIZE=" + strconv.Itoa(j.World),
		"RANK=" + strconv.Itoa(j.Rank),
		"LOCAL_RANK=" + strconv.Itoa(j.LocalRank),
		"MASTER_ADDR=" + host,
		"MASTER_PORT=" + port,
	}
	if j.Timeout > 0 {
		env = append(env, "QTOOL_TP_TIMEOUT="+j.Timeout.String())
	}
	return env
}

func (j Job) timeout() time.Duration {
	if j.Timeout > 0 {
		return j.Timeout
	}
	return DefaultTimeout
}
