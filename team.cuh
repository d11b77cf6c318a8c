// team.cuh: many GPUs: the team of processes (one per GPU) and its NCCL collectives, the launchers'
// environments (torchrun, mpirun, srun), the rendezvous and `--gpus N`'s launcher. Needs only
// gpu.cuh; train_unet.cu includes it at its top (one translation unit).
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>

// ----------------------------------------------------------------------------------------------
// Many GPUs: one process per GPU, data parallel (guided-diffusion's DDP, on NCCL directly). Each
// process, a rank, holds the whole model and takes its own B images of the step's N B, numbered
// within them as one GPU at batch N B numbers them (data order, noise, timesteps, dropout). The
// step's graph averages the gradients over the ranks (NCCL all-reduces captured with the kernels,
// in buckets beside backward: team_plan_buckets) and then the loss, so every rank takes the same
// AdamW step and the weights stay equal.
// How the processes start and find each other: below (launch_gpus, team_from_environment, team_join).

#ifdef UNET_NO_NCCL
typedef void *ncclComm_t;  // built without NCCL (the Makefile found none): one process only
#else
#include <nccl.h>
#endif

typedef struct {
    int rank, world;            // this process's number and the number of processes (GPUs) in all
    int local_rank;             // the GPU this process takes on its machine
    ncclComm_t comm;            // NULL for a process started alone
    cudaStream_t stream;        // the gradients' all-reduce, beside backward
    cudaEvent_t fork, join;
} Team;
static Team team = {0, 1, 0, NULL, NULL, NULL, NULL};

// A signal asked this process to stop (SIGINT, SIGTERM; the handlers are the training run's): after
// its step, all stop. SIGUSR1 is --gpus's word that another rank failed: no step can finish now.
static volatile sig_atomic_t stop_requested, peer_lost;

// A wait on the step may last this long before the other ranks are taken to be gone (seconds): an
// ordinary step takes milliseconds; before the first one every rank loads its data and checkpoint
// at its own pace (team_warm_up), and after a checkpoint or a sample grid the others wait for rank
// 0 to write it.
#define TEAM_STEP_TIMEOUT 30.0  // or 50 times the slowest ordinary step so far, when that is longer
#define TEAM_START_TIMEOUT 600.0
#define TEAM_SLOW_STEP_TIMEOUT 1800.0

#ifndef UNET_NO_NCCL
static void nccl_check_(ncclResult_t r, const char *what, int line) {
    if (r != ncclSuccess)
        fatal("NCCL: %s (%s at train_unet.cu:%d)%s%s", ncclGetErrorString(r), what, line, team.comm ? ": " : "",
              team.comm ? ncclGetLastError(team.comm) : "");
}
#define nccl_check(call) nccl_check_((call), #call, __LINE__)
#endif

// x = the mean over the ranks of x (n floats, in place), on the stream; nothing alone.
static void team_average(float *x, size_t n, cudaStream_t stream) {
#ifndef UNET_NO_NCCL
    if (team.comm) nccl_check(ncclAllReduce(x, x, n, ncclFloat32, ncclAvg, team.comm, stream));
#endif
}

// The same beside the main stream, on team.stream, after the main stream's work so far (a fork).
static void team_average_beside(float *x, size_t n) {
    cuda_check(cudaEventRecord(team.fork, gpu.main));
    cuda_check(cudaStreamWaitEvent(team.stream, team.fork, 0));
    team_average(x, n, team.stream);
}

// The main stream waits for the averages begun beside it (the join).
static void team_join_beside(void) {
    cuda_check(cudaEventRecord(team.join, team.stream));
    cuda_check(cudaStreamWaitEvent(gpu.main, team.join, 0));
}

// all = every rank's x (n floats each), in the order of the ranks, on the stream; alone a copy.
static void team_gather(const float *x, float *all, size_t n, cudaStream_t stream) {
#ifndef UNET_NO_NCCL
    if (team.comm) {
        nccl_check(ncclAllGather(x, all, n, ncclFloat32, team.comm, stream));
        return;
    }
#endif
    cuda_check(cudaMemcpyAsync(all, x, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
}

// x = rank 0's x (n bytes, in place), on the stream; nothing alone.
static void team_broadcast(void *x, size_t n, cudaStream_t stream) {
#ifndef UNET_NO_NCCL
    if (team.comm) nccl_check(ncclBroadcast(x, x, n, ncclUint8, 0, team.comm, stream));
#endif
}

// x = the largest over the ranks of x (n ints, in place), on the stream; nothing alone.
static void team_max(int *x, size_t n, cudaStream_t stream) {
#ifndef UNET_NO_NCCL
    if (team.comm) nccl_check(ncclAllReduce(x, x, n, ncclInt32, ncclMax, team.comm, stream));
#endif
}

// Gives up on a step that cannot finish: one line, exit status 1 at once. (ncclCommAbort would
// wait for the step's kernels, which wait for the missing rank: on two H200s it was still waiting
// after 10 s. The driver ends them with the process.)
static void team_give_up(const char *fmt, ...) __attribute__((noreturn));
static void team_give_up(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    print_error("", fmt, args);
    va_end(args);
    _exit(1);
}

// The rendezvous's connections, kept open for the run where the ranks met over TCP (rendezvous_tcp):
// rank 0's to each other rank r at team_links[r], another rank's to rank 0 at team_links[0] (-1:
// none). A process that ends, however it ends, has its connections closed by the kernel, so the
// team learns which rank is gone, not only that a step does not finish. What goes over a link: 'D',
// a rank's clean end (team_leave; the connection closes after it), and from rank 0 to the others
// 'X' and the int32 rank it saw go.
static int *team_links;
static int rendezvous_io(int fd, void *buf, size_t n, double deadline, int writing);  // (with the rendezvous, below)

// The rank that is gone, by the links, or -1 while none is: on rank 0, a link closed without 'D'
// (and rank 0 tells the others, 'X'); on another, rank 0's 'X' names one, and rank 0's link closed
// without 'D' names rank 0.
static int team_lost_rank(void) {
    for (int i = 0; team_links && i < team.world; i++) {
        struct pollfd p = {team_links[i], POLLIN, 0};
        if (p.fd < 0 || poll(&p, 1, 0) <= 0) continue;
        uint8_t what = 0;
        ssize_t k = recv(p.fd, &what, 1, MSG_DONTWAIT);
        if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (k == 1 && what == 'D') {
            close(p.fd), team_links[i] = -1;
            continue;
        }
        int32_t lost = i;
        if (k == 1 && what == 'X' && (rendezvous_io(p.fd, &lost, 4, now_seconds() + 1, 0) != 0 || lost < 0 || lost >= team.world))
            lost = 0;  // rank 0 went while it spoke
        if (team.rank == 0) {
            uint8_t word[5] = {'X'};
            memcpy(word + 1, &lost, 4);
            for (int j = 1; j < team.world; j++)
                if (team_links[j] >= 0 && j != i) send(team_links[j], word, sizeof word, MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        return lost;
    }
    return -1;
}

// This rank's clean end: 'D' over its links, which it closes.
static void team_leave(void) {
    for (int i = 0; team_links && i < team.world; i++)
        if (team_links[i] >= 0) send(team_links[i], "D", 1, MSG_NOSIGNAL | MSG_DONTWAIT), close(team_links[i]), team_links[i] = -1;
}

// Waits until `done` (recorded after the step) has happened. Alone: a plain synchronisation. A
// rank that died leaves the others inside the all-reduce for good, so a team polls (sleeping
// 100 us between polls after the first 2 ms), and gives up at once when the links (every 10 ms)
// or --gpus say that a rank failed, else after `timeout` seconds. Returns the seconds waited (a
// team's).
static double team_wait(cudaEvent_t done, double timeout, int64_t step) {
    if (!team.comm) {
        cuda_check(cudaEventSynchronize(done));
        return 0.0;
    }
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    double links_checked = 0.0;
    for (;;) {
        cudaError_t r = cudaEventQuery(done);
        clock_gettime(CLOCK_MONOTONIC, &t);
        double waited = (t.tv_sec - t0.tv_sec) + 1e-9 * (t.tv_nsec - t0.tv_nsec);
        if (r == cudaSuccess) return waited;
        if (r != cudaErrorNotReady) cuda_check(r);
        if (peer_lost) team_give_up("another rank of this run failed; stopping in step %lld", (long long)step);
        if (waited - links_checked > 0.01) {
            int lost = team_lost_rank();
            if (lost >= 0) team_give_up("rank %d of this run has stopped; stopping in step %lld", lost, (long long)step);
            links_checked = waited;
        }
        if (waited > timeout)
            team_give_up("step %lld has not finished after %.0f s: another rank of this run has stopped or hangs; stopping",
                         (long long)step, waited);
        if (waited > 0.002) usleep(100);
    }
}

// Starting the ranks and joining them.
// `--gpus N` starts N copies of this command on this machine (launch_gpus); any other launcher
// (torchrun, mpirun, srun) starts them itself and says which is which in the environment. Every
// rank then joins one NCCL communicator through a file of the run folder, written by rank 0.

// The rank of this process when a launcher started it, from the first of these sets whose world
// size is set: torchrun's (which --gpus sets too), Open MPI's, Slurm's srun. Returns 1 with team
// filled, or 0 when none is set (a process alone); exits with one line on an incomplete or bad set.
// A world of one from Open MPI or Slurm is a process alone too (a shell inside `srun --pty` has
// one); from torchrun's variables it is a team of one rank (which the tests use).
static int team_from_environment(Team *t) {
    static const char *const sets[][3] = {{"RANK", "WORLD_SIZE", "LOCAL_RANK"},
                                          {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
                                          {"SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"}};
    for (int k = 0; k < 3; k++) {
        if (!getenv(sets[k][1])) continue;
        long v[3];
        for (int i = 0; i < 3; i++) {
            const char *text = getenv(sets[k][i]);
            char *end;
            v[i] = text ? strtol(text, &end, 10) : -1;
            if (!text || !*text || *end || v[i] < 0 || v[i] > 1000000)
                fatal("%s is %s%s%s: a launcher sets %s, %s and %s together, to numbers", sets[k][i], text ? "'" : "unset",
                      text ? text : "", text ? "'" : "", sets[k][0], sets[k][1], sets[k][2]);
        }
        if (v[1] < 1 || v[0] >= v[1]) fatal("%s %ld is not below %s %ld", sets[k][0], v[0], sets[k][1], v[1]);
        if (k > 0 && v[1] == 1) return 0;
        t->rank = (int)v[0], t->world = (int)v[1], t->local_rank = (int)v[2];
        return 1;
    }
    return 0;
}

#ifndef UNET_NO_NCCL
// The file through which rank 0 hands the others NCCL's id: RUN_DIR/nccl_id, suffixed with the
// launcher's job name where it gives one, so that no rank can read an earlier run's file.
static void team_id_path(char *out, size_t len, const char *run_dir) {
    static const char *const jobs[] = {"TRAIN_UNET_JOB", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID", "PMIX_NAMESPACE",
                                       "OMPI_MCA_ess_base_jobid"};
    const char *slurm_job = getenv("SLURM_JOB_ID");
    char slurm[64];
    const char *job = NULL;
    for (size_t i = 0; i < sizeof jobs / sizeof jobs[0] && !job; i++) {
        job = getenv(jobs[i]);
        if (job && strcmp(job, "none") == 0) job = NULL;  // torchrun's default run id names no run
        if (job && i == 2) snprintf(slurm, sizeof slurm, "%s.%s", slurm_job ? slurm_job : "", job), job = slurm;  // job.step
    }
    int n = snprintf(out, len, "%s/nccl_id%s", run_dir, job ? "_" : "");
    for (const char *c = job; c && *c && n + 1 < (int)len; c++, n++)  // a file name's characters only
        out[n] = isalnum((unsigned char)*c) || *c == '.' || *c == '-' ? *c : '_', out[n + 1] = '\0';
}
#endif

// The rendezvous over TCP, as torchrun's: rank 0 listens on host:port (MASTER_ADDR, MASTER_PORT),
// every other rank connects (again every 0.2 s until it is up) and says who it is: "UNETRDZV", its
// rank and world size (int32 each) and its configuration (a uint32 length and the text: "name
// value" items separated by "; ", which every rank must have alike). When all world - 1 have
// arrived, and agree, rank 0 answers each with status 0 and `payload` (NCCL's id); on any
// disagreement it answers every rank that came with status 1 and one line naming the difference,
// and all stop with that line. Every wait is bounded by timeout_s. Returns 0 (the others with
// rank 0's payload in `payload`), or -1 with the line in err.
#define RENDEZVOUS_MAGIC "UNETRDZV"

// A rendezvous port (MASTER_PORT's, --rdzv's): 1 to 5 decimal digits, no sign or space, 1..65535;
// returns it, or -1.
static int rendezvous_port(const char *text) {
    size_t digits = strspn(text, "0123456789");
    if (digits < 1 || digits > 5 || text[digits]) return -1;
    long port = strtol(text, NULL, 10);
    return port >= 1 && port <= 65535 ? (int)port : -1;
}

// Whether a rendezvous host is well-formed: a name or IPv4 address (letters, digits, '.', '-' and
// '_'), or, when it stood in brackets, an IPv6 address (with a %zone where it has one).
static int rendezvous_host_valid(const char *host, int bracketed) {
    const char *name = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_";
    if (!bracketed) return host[0] && !host[strspn(host, name)];
    char address[256];
    struct in6_addr a;
    const char *zone = strchr(host, '%');
    snprintf(address, sizeof address, "%.*s", zone ? (int)(zone - host) : (int)strlen(host), host);
    return inet_pton(AF_INET6, address, &a) == 1 && (!zone || (zone[1] && !zone[1 + strspn(zone + 1, name)]));
}

// host:port into host, the host a name or IPv4 address, or an IPv6 address in brackets ([::1]:29500):
// one colon outside brackets, before the port (rendezvous_port). Returns the port, or -1.
static int rendezvous_address(const char *address, char *host, size_t host_len) {
    const char *colon = strrchr(address, ':');
    int bracketed = address[0] == '[';
    if (!colon || (size_t)(colon - address) >= host_len || (bracketed && (colon - address < 2 || colon[-1] != ']'))) return -1;
    snprintf(host, host_len, "%.*s", (int)(colon - address) - 2 * bracketed, address + bracketed);
    return rendezvous_host_valid(host, bracketed) ? rendezvous_port(colon + 1) : -1;
}

// The rendezvous of a team into rdzv: --rdzv's (`given`, checked with the options), else torchrun's
// MASTER_ADDR and MASTER_PORT when both are set (an IPv6 MASTER_ADDR put in brackets), else "" (the
// run folder's file). Checked as --rdzv is, before the GPU: exits with one line naming the variable.
// *agent_store: whether rdzv is torchrun's agent store (MASTER_* with TORCHELASTIC_USE_AGENT_STORE
// True), which the ranks reach as its clients (rendezvous_store), not a port rank 0 listens on.
static void rendezvous_from_environment(const char *given, char *rdzv, size_t len, int *agent_store) {
    const char *master = getenv("MASTER_ADDR"), *master_port = getenv("MASTER_PORT"), *use_store = getenv("TORCHELASTIC_USE_AGENT_STORE");
    char host[256];
    snprintf(rdzv, len, "%s", given);
    *agent_store = 0;
    if (given[0] || !master || !master[0] || !master_port || !master_port[0]) return;
    if (rendezvous_port(master_port) < 0)
        fatal("MASTER_PORT is '%s': the rendezvous port must be a number in 1..65535, digits only", master_port);
    if (snprintf(rdzv, len, strchr(master, ':') ? "[%s]:%s" : "%s:%s", master, master_port) >= (int)len ||
        rendezvous_address(rdzv, host, sizeof host) < 0)
        fatal("MASTER_ADDR is '%s': the rendezvous host must be a host name, an IPv4 address or an IPv6 address", master);
    *agent_store = use_store && strcmp(use_store, "True") == 0;
}
#define RENDEZVOUS_MAX_CONFIG 4096

// Waits until fd is readable (events POLLIN) or writable (POLLOUT), at most until `deadline`
// (now_seconds()), in slices that notice a stop request. Returns 1 ready, 0 at the deadline or a stop.
static int rendezvous_wait(int fd, short events, double deadline) {
    while (!stop_requested) {
        double left = deadline - now_seconds();
        if (left <= 0) return 0;
        struct pollfd p = {fd, events, 0};
        int r = poll(&p, 1, (int)fmin(left * 1000 + 1, 200));
        if (r > 0) return 1;
        if (r < 0 && errno != EINTR) return 0;
    }
    return 0;
}

// Reads or writes n bytes by `deadline`. Returns 0, or -1.
static int rendezvous_io(int fd, void *buf, size_t n, double deadline, int writing) {
    for (size_t done = 0; done < n;) {
        if (!rendezvous_wait(fd, writing ? POLLOUT : POLLIN, deadline)) return -1;
        ssize_t k = writing ? send(fd, (char *)buf + done, n - done, MSG_NOSIGNAL) : recv(fd, (char *)buf + done, n - done, 0);
        if (k <= 0 && !(k < 0 && (errno == EINTR || errno == EAGAIN))) return -1;
        if (k > 0) done += (size_t)k;
    }
    return 0;
}

// A connection to one of the addresses ai, tried again every 0.2 s until one answers, `deadline`
// (now_seconds()) passes or a stop is asked for. Returns the socket (non-blocking), or -1.
static int rendezvous_connect(const struct addrinfo *ai, double deadline) {
    int fd = -1;
    while (fd < 0 && now_seconds() < deadline && !stop_requested) {
        for (const struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
            fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
            if (fd < 0) continue;
            int ok = connect(fd, a->ai_addr, a->ai_addrlen) == 0 ||
                     (errno == EINPROGRESS && rendezvous_wait(fd, POLLOUT, fmin(deadline, now_seconds() + 1)));
            int so_error = 0;
            socklen_t so_len = sizeof so_error;
            if (ok && (getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &so_len) != 0 || so_error != 0)) ok = 0;
            if (!ok) close(fd), fd = -1;
        }
        if (fd < 0) usleep(200000);
    }
    return fd;
}

// A reply: its status (0: the payload follows; 1: an error line) and its bytes.
static void rendezvous_reply(int fd, uint8_t status, const void *bytes, uint32_t len, double deadline) {
    if (rendezvous_io(fd, &status, 1, deadline, 1) == 0 && rendezvous_io(fd, &len, 4, deadline, 1) == 0)
        rendezvous_io(fd, (void *)bytes, len, deadline, 1);
}

// Rank 0's judgement of rank `rank`'s world size and configuration against its own: "" when they
// agree, else the line naming the difference: for the configuration its first "name value" item
// that differs, "NAME THEIRS against NAME MINE" (an item only one has: against "nothing").
static void rendezvous_judge(char *out, size_t len, int rank, int their_world, int world, const char *theirs, const char *mine) {
    out[0] = '\0';
    if (their_world != world) snprintf(out, len, "rendezvous: rank %d has WORLD_SIZE %d, rank 0 %d", rank, their_world, world);
    if (their_world != world || strcmp(theirs, mine) == 0) return;
    char a[RENDEZVOUS_MAX_CONFIG + 1], b[RENDEZVOUS_MAX_CONFIG + 1];
    snprintf(a, sizeof a, "%s", theirs), snprintf(b, sizeof b, "%s", mine);
    char *sa, *sb, *x = strtok_r(a, ";", &sa), *y = strtok_r(b, ";", &sb);
    while (x && y && strcmp(x, y) == 0) x = strtok_r(NULL, ";", &sa), y = strtok_r(NULL, ";", &sb);
    snprintf(out, len, "rendezvous: rank %d's configuration differs from rank 0's: %s against %s", rank, x ? x + strspn(x, " ") : "nothing",
             y ? y + strspn(y, " ") : "nothing");
}

static int rendezvous_tcp(const char *host, int port, int rank, int world, const char *config, double timeout_s, void *payload,
                          uint32_t payload_len, char *err, size_t err_len) {
    double deadline = now_seconds() + timeout_s;
    char port_text[16];
    snprintf(port_text, sizeof port_text, "%d", port);
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC, hints.ai_socktype = SOCK_STREAM, hints.ai_flags = rank == 0 ? AI_PASSIVE : 0;
    int gai = getaddrinfo(rank == 0 ? NULL : host, port_text, &hints, &ai);
    if (gai != 0) return error_line(err, err_len, "rendezvous: cannot resolve MASTER_ADDR %s: %s", host, gai_strerror(gai));
    int r = -1;
    if (rank == 0) {
        int listener = -1;
        for (struct addrinfo *a = ai; a && listener < 0; a = a->ai_next) {
            listener = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
            int one = 1, zero = 0;  // (an IPv6 socket takes IPv4 connections too)
            if (listener >= 0 && a->ai_family == AF_INET6) setsockopt(listener, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
            if (listener >= 0) setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
            if (listener >= 0 && (bind(listener, a->ai_addr, a->ai_addrlen) != 0 || listen(listener, world) != 0)) {
                int e = errno;
                close(listener), listener = -1, errno = e;
            }
        }
        freeaddrinfo(ai);
        if (listener < 0)
            return error_line(err, err_len, errno == EADDRINUSE ? "rendezvous: MASTER_PORT %d is in use on this machine: choose another"
                                                                : "rendezvous: cannot listen on port %d: %s", port, strerror(errno));
        int *fds = (int *)malloc_or_die(world * sizeof(int));
        for (int i = 0; i < world; i++) fds[i] = -1;
        int arrived = 1;
        char line[600] = "";
        while (arrived < world && !line[0]) {
            if (!rendezvous_wait(listener, POLLIN, deadline)) {
                char missing[256] = "";
                for (int i = 1; i < world && strlen(missing) < 200; i++)
                    if (fds[i] < 0) snprintf(missing + strlen(missing), sizeof missing - strlen(missing), "%s%d", missing[0] ? ", " : "", i);
                snprintf(line, sizeof line, stop_requested ? "rendezvous: stopped while waiting for rank %s"
                                                           : "rendezvous: rank %s never arrived at port %d within %.0f s", missing, port, timeout_s);
                break;
            }
            int fd = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
            if (fd < 0) continue;
            char magic[8];
            int32_t who[2];
            uint32_t len = 0;
            char theirs[RENDEZVOUS_MAX_CONFIG + 1];
            double hello_deadline = fmin(deadline, now_seconds() + 10);
            if (rendezvous_io(fd, magic, 8, hello_deadline, 0) != 0 || memcmp(magic, RENDEZVOUS_MAGIC, 8) != 0 ||
                rendezvous_io(fd, who, 8, hello_deadline, 0) != 0 || rendezvous_io(fd, &len, 4, hello_deadline, 0) != 0 ||
                len > RENDEZVOUS_MAX_CONFIG || rendezvous_io(fd, theirs, len, hello_deadline, 0) != 0) {
                close(fd);  // not one of ours (a port scanner, a stale client): ignored
                continue;
            }
            theirs[len] = '\0';
            if (who[1] == world && (who[0] < 1 || who[0] >= world || fds[who[0]] >= 0))
                snprintf(line, sizeof line, "rendezvous: rank %d %s", who[0], who[0] < 1 || who[0] >= world ? "is out of range" : "arrived twice");
            else rendezvous_judge(line, sizeof line, who[0], who[1], world, theirs, config);
            if (line[0]) rendezvous_reply(fd, 1, line, (uint32_t)strlen(line), fmin(deadline, now_seconds() + 5)), close(fd);
            else fds[who[0]] = fd, arrived++;
        }
        for (int i = 1; i < world; i++) {
            if (fds[i] < 0) continue;
            double reply_deadline = now_seconds() + 5;
            if (line[0]) rendezvous_reply(fds[i], 1, line, (uint32_t)strlen(line), reply_deadline);
            else rendezvous_reply(fds[i], 0, payload, payload_len, reply_deadline);
            if (line[0]) close(fds[i]), fds[i] = -1;
        }
        close(listener);
        if (line[0]) free(fds);
        else free(team_links), team_links = fds;  // kept for the run (fds[0] is -1)
        r = line[0] ? error_line(err, err_len, "%s", line) : 0;
    } else {
        int fd = rendezvous_connect(ai, deadline);  // rank 0 may not be listening yet
        freeaddrinfo(ai);
        if (fd < 0)
            return error_line(err, err_len, stop_requested ? "rendezvous: rank %d stopped while reaching rank 0 at %s:%d"
                                                           : "rendezvous: rank %d cannot reach rank 0 at %s:%d within %.0f s", rank, host,
                              port, timeout_s);
        int32_t who[2] = {rank, world};
        uint32_t len = (uint32_t)strlen(config);
        uint8_t status = 1;
        uint32_t reply_len = 0;
        // Rank 0 listened before this connection and answers within timeout_s of its start (and 5 s
        // to send): waiting that long from now, plus a margin, hears its answer whatever it is.
        deadline = now_seconds() + timeout_s + 10;
        if (rendezvous_io(fd, (void *)RENDEZVOUS_MAGIC, 8, deadline, 1) != 0 || rendezvous_io(fd, who, 8, deadline, 1) != 0 ||
            rendezvous_io(fd, &len, 4, deadline, 1) != 0 || rendezvous_io(fd, (void *)config, len, deadline, 1) != 0 ||
            rendezvous_io(fd, &status, 1, deadline, 0) != 0 || rendezvous_io(fd, &reply_len, 4, deadline, 0) != 0)
            r = stop_requested ? error_line(err, err_len, "rendezvous: rank %d stopped while waiting for rank 0 at %s:%d", rank, host, port)
                : now_seconds() < deadline
                    ? error_line(err, err_len, "rendezvous: rank 0 at %s:%d closed the connection before answering rank %d (it stopped)",
                                 host, port, rank)
                    : error_line(err, err_len, "rendezvous: rank 0 at %s:%d did not answer rank %d within %.0f s", host, port, rank,
                                 timeout_s + 10);
        else if (status == 0 && reply_len == payload_len && rendezvous_io(fd, payload, payload_len, deadline, 0) == 0)
            r = 0;
        else {
            char line[600] = "rendezvous: rank 0 refused this rank";
            if (status == 1 && reply_len < sizeof line && rendezvous_io(fd, line, reply_len, deadline, 0) == 0) line[reply_len] = '\0';
            r = error_line(err, err_len, "%s", line);
        }
        if (r == 0) {  // the link to rank 0, kept for the run
            free(team_links);
            team_links = (int *)malloc_or_die(world * sizeof(int));
            for (int i = 0; i < world; i++) team_links[i] = i == 0 ? fd : -1;
        } else {
            close(fd);
        }
    }
    return r;
}

// ---- torchrun's agent store ----
// Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) MASTER_ADDR:MASTER_PORT is its agent's c10d
// TCPStore, which the ranks use as clients rather than listen there. The store's wire protocol
// (PyTorch's TCPStore, host byte order): a connection first sends VALIDATE and the magic number;
// a query is its type byte and its arguments, a key or a value as a uint64 length and its bytes:
//   SET key value             no answer
//   GET key                   answers the value (uint64 length, bytes); the key must exist
//   ADD key int64             answers the new int64 (the key starts at 0)
//   CHECK uint64 n, n keys    answers a byte, 0 when every key exists
// The rendezvous in it: keys under train_unet/RUN_ID/RESTART/ (torchrun's run id and restart count,
// so that a restart meets afresh). Rank r > 0 sets cfg/r (its world size, int32, then its
// configuration), adds 1 to `arrived` and polls `answer`; rank 0 polls `arrived` until the world - 1
// others are there, compares each cfg/r with its own, and sets `answer`: status 0 and the payload,
// or 1 and the line naming the first difference, as rendezvous_tcp answers.
enum { STORE_VALIDATE = 0, STORE_SET = 1, STORE_GET = 3, STORE_ADD = 4, STORE_CHECK = 5 };
#define STORE_MAGIC 0x3C85F7CEu

#define STORE_REPLY_SECONDS 30  // the longest a query and its answer may take (the store answers at once)

// A query is put together whole in `out` and sent in one write, as PyTorch's own client sends it:
// its server, given a query in pieces, at times closed the connection (seen with PyTorch 2.15 on a
// loaded machine).
typedef struct {
    int fd;
    double deadline;   // of the query under way: STORE_REPLY_SECONDS from its sending
    char prefix[192];  // of this run's keys
    uint8_t out[RENDEZVOUS_MAX_CONFIG + 512];
    size_t len;        // of the query in out (more than out holds: too long, not sent)
} StoreClient;

static void store_put(StoreClient *s, const void *bytes, uint64_t n) {
    if (s->len + n <= sizeof s->out) memcpy(s->out + s->len, bytes, n);
    s->len += n;
}

// A key: the run's prefix, then key, as a uint64 length and the bytes.
static void store_put_key(StoreClient *s, const char *key) {
    char full[320];
    uint64_t n = (uint64_t)snprintf(full, sizeof full, "%s%s", s->prefix, key);
    store_put(s, &n, 8), store_put(s, full, n);
}

// Sends the query put together, starting its time. Returns 0, or -1.
static int store_send(StoreClient *s) {
    s->deadline = now_seconds() + STORE_REPLY_SECONDS;
    int r = s->len <= sizeof s->out ? rendezvous_io(s->fd, s->out, s->len, s->deadline, 1) : -1;
    s->len = 0;
    return r;
}

// Reads n bytes of the answer. Returns 0, or -1 on a broken connection or at the deadline.
static int store_read(StoreClient *s, void *bytes, uint64_t n) { return rendezvous_io(s->fd, bytes, n, s->deadline, 0); }

static int store_validate(StoreClient *s) {
    uint8_t type = STORE_VALIDATE;
    uint32_t magic = STORE_MAGIC;
    store_put(s, &type, 1), store_put(s, &magic, 4);
    return store_send(s);
}

static int store_set(StoreClient *s, const char *key, const void *value, uint64_t len) {
    uint8_t type = STORE_SET;
    store_put(s, &type, 1), store_put_key(s, key), store_put(s, &len, 8), store_put(s, value, len);
    return store_send(s);
}

// The value of key (which exists) into value (at most cap bytes): its length, or -1.
static int64_t store_get(StoreClient *s, const char *key, void *value, uint64_t cap) {
    uint8_t type = STORE_GET;
    uint64_t n;
    store_put(s, &type, 1), store_put_key(s, key);
    if (store_send(s) || store_read(s, &n, 8) || n > cap || store_read(s, value, n)) return -1;
    return (int64_t)n;
}

// key += amount: the new value, or -1 (a counter here never is).
static int64_t store_add(StoreClient *s, const char *key, int64_t amount) {
    uint8_t type = STORE_ADD;
    int64_t total;
    store_put(s, &type, 1), store_put_key(s, key), store_put(s, &amount, 8);
    return store_send(s) || store_read(s, &total, 8) ? -1 : total;
}

// Whether key exists: 1 or 0, or -1 on a broken connection.
static int store_exists(StoreClient *s, const char *key) {
    uint8_t type = STORE_CHECK, ready;
    uint64_t one = 1;
    store_put(s, &type, 1), store_put(s, &one, 8), store_put_key(s, key);
    if (store_send(s) || store_read(s, &ready, 1)) return -1;
    return ready == 0;
}

// The rendezvous through the store at host:port (see above; arguments and result as rendezvous_tcp's).
static int rendezvous_store(const char *host, int port, int rank, int world, const char *config, double timeout_s, void *payload,
                            uint32_t payload_len, char *err, size_t err_len) {
    StoreClient s;
    s.len = 0;
    double until = now_seconds() + timeout_s;  // of the waits for the others
    const char *run = getenv("TORCHELASTIC_RUN_ID"), *restart = getenv("TORCHELASTIC_RESTART_COUNT");
    snprintf(s.prefix, sizeof s.prefix, "train_unet/%s/%s/", run && run[0] ? run : "none", restart && restart[0] ? restart : "0");
    char port_text[16];
    snprintf(port_text, sizeof port_text, "%d", port);
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC, hints.ai_socktype = SOCK_STREAM;
    int gai = getaddrinfo(host, port_text, &hints, &ai);
    if (gai != 0) return error_line(err, err_len, "rendezvous: cannot resolve MASTER_ADDR %s: %s", host, gai_strerror(gai));
    s.fd = rendezvous_connect(ai, until);
    freeaddrinfo(ai);
    if (s.fd < 0)
        return error_line(err, err_len, stop_requested ? "rendezvous: rank %d stopped while reaching torchrun's store at %s:%d"
                                                       : "rendezvous: rank %d cannot reach torchrun's store at %s:%d within %.0f s", rank,
                          host, port, timeout_s);
    int broken = store_validate(&s);
    char line[600] = "", key[32];
    uint8_t *answer = (uint8_t *)malloc_or_die(RENDEZVOUS_MAX_CONFIG + 8 + payload_len);
    if (!broken && rank > 0) {  // say who we are, then wait for rank 0's answer
        int32_t size = world;
        size_t n = strlen(config);
        if (n > RENDEZVOUS_MAX_CONFIG) fatal("rendezvous: a configuration of %zu bytes (at most %d)", n, RENDEZVOUS_MAX_CONFIG);
        memcpy(answer, &size, 4), memcpy(answer + 4, config, n);
        snprintf(key, sizeof key, "cfg/%d", rank);
        broken = store_set(&s, key, answer, 4 + n) || store_add(&s, "arrived", 1) < 0;
        until = now_seconds() + timeout_s + 10;  // rank 0 answers within timeout_s of its start, whatever the answer
        int ready = 0;
        while (!broken && !(ready = store_exists(&s, "answer")) && now_seconds() < until && !stop_requested) usleep(100000);
        int64_t got = ready > 0 ? store_get(&s, "answer", answer, RENDEZVOUS_MAX_CONFIG + 1 + payload_len) : -1;
        if (got >= 1 && answer[0] == 0 && got == 1 + (int64_t)payload_len) memcpy(payload, answer + 1, payload_len);
        else if (got >= 1 && answer[0] == 1) snprintf(line, sizeof line, "%.*s", (int)(got - 1), (const char *)answer + 1);
        else if (stop_requested) snprintf(line, sizeof line, "rendezvous: rank %d stopped while waiting for rank 0", rank);
        else if (!broken && ready == 0) snprintf(line, sizeof line, "rendezvous: rank 0 did not answer rank %d in torchrun's store within %.0f s", rank, timeout_s);
        else broken = 1;
    } else if (!broken) {  // wait for the others, check them, answer
        int64_t arrived = 0;
        while ((arrived = store_add(&s, "arrived", 0)) >= 0 && arrived < world - 1 && now_seconds() < until && !stop_requested)
            usleep(100000);
        broken = arrived < 0;
        if (!broken && arrived < world - 1) {
            char missing[256] = "";
            for (int i = 1; i < world && strlen(missing) < 200; i++) {
                snprintf(key, sizeof key, "cfg/%d", i);
                if (store_exists(&s, key) == 0) snprintf(missing + strlen(missing), sizeof missing - strlen(missing), "%s%d", missing[0] ? ", " : "", i);
            }
            snprintf(line, sizeof line, stop_requested ? "rendezvous: stopped while waiting for rank %s in torchrun's store"
                                                       : "rendezvous: rank %s never arrived in torchrun's store within %.0f s", missing, timeout_s);
        }
        for (int i = 1; i < world && !broken && !line[0]; i++) {
            snprintf(key, sizeof key, "cfg/%d", i);
            int exists = store_exists(&s, key);
            if (exists == 0) {  // the others' count is full without it: another rank came twice
                snprintf(line, sizeof line, "rendezvous: rank %d never arrived in torchrun's store, but %d others did: a rank came twice", i,
                         world - 1);
                break;
            }
            int64_t got = exists > 0 ? store_get(&s, key, answer, RENDEZVOUS_MAX_CONFIG + 4) : -1;
            int32_t size;
            if (got < 4) {
                broken = 1;
                break;
            }
            memcpy(&size, answer, 4), answer[got] = '\0';
            rendezvous_judge(line, sizeof line, i, size, world, (const char *)answer + 4, config);
        }
        size_t n = line[0] ? strlen(line) : payload_len;
        answer[0] = line[0] ? 1 : 0, memcpy(answer + 1, line[0] ? (const void *)line : payload, n);
        if (!broken) broken = store_set(&s, "answer", answer, 1 + n);
    }
    free(answer);
    close(s.fd);
    if (!line[0] && stop_requested) snprintf(line, sizeof line, "rendezvous: rank %d stopped while meeting in torchrun's store", rank);
    else if (broken && !line[0])
        snprintf(line, sizeof line, "rendezvous: torchrun's store at %s:%d closed the connection of rank %d (the agent stopped?)", host, port, rank);
    return line[0] ? error_line(err, err_len, "%s", line) : 0;
}

// Joins this rank to the others (team.comm): rank 0 writes NCCL's id into the run folder (under a
// temporary name, then renamed, so no rank reads half of it), the others wait for it (up to 10
// minutes: the run folder must be on a file system every machine of the run sees), every rank
// opens the communicator, and rank 0 removes the file. A file older than this process by more than
// a minute (the clocks of other machines may differ by some seconds) is a dead run's: not read.
// With a rendezvous address (rdzv, host:port), the id goes over TCP instead (rendezvous_tcp, or with
// agent_store through torchrun's store there: rendezvous_store), with a check that every rank has
// the same configuration (`config`), each wait at most timeout_s.
static void team_join(const char *run_dir, const char *rdzv, int agent_store, int timeout_s, const char *config) {
#ifdef UNET_NO_NCCL
    (void)run_dir, (void)rdzv, (void)agent_store, (void)timeout_s, (void)config;
    fatal("this train_unet was built without NCCL (the Makefile found no nccl.h), so it trains on one GPU only");
#else
    char path[4400], tmp[4500];
    team_id_path(path, sizeof path, run_dir);
    ncclUniqueId id;
    if (rdzv[0]) {
        char host[256], err[1024];
        int port = rendezvous_address(rdzv, host, sizeof host);
        if (port < 0) fatal("rendezvous address '%s' must be host:port", rdzv);
        if (team.rank == 0) nccl_check(ncclGetUniqueId(&id));
        int r = agent_store ? rendezvous_store(host, port, team.rank, team.world, config, timeout_s, &id, sizeof id, err, sizeof err)
                            : rendezvous_tcp(host, port, team.rank, team.world, config, timeout_s, &id, sizeof id, err, sizeof err);
        if (r != 0) fatal("%s", err);
        if (team.rank == 0)
            printf("rendezvous: %d rank%s met %s %s\n", team.world, team.world == 1 ? "" : "s", agent_store ? "in torchrun's store at" : "at",
                   rdzv);
    } else if (team.rank == 0) {
        if (make_dir_synced(run_dir) != 0) fatal("cannot create run folder %s: %s", run_dir, strerror(errno));
        nccl_check(ncclGetUniqueId(&id));
        snprintf(tmp, sizeof tmp, "%s.tmp", path);
        FILE *f = fopen(tmp, "wb");
        if (!f || write_all(f, &id, sizeof id) != 0 || fflush(f) != 0 || fsync(fileno(f)) != 0 || fclose(f) != 0 ||
            rename(tmp, path) != 0)
            fatal("cannot write %s: %s", path, strerror(errno));
    } else {
        time_t started = time(NULL);
        for (int waited_ms = 0;; waited_ms += 50) {
            struct stat st;
            FILE *f = stat(path, &st) == 0 && st.st_mtime >= started - 60 ? fopen(path, "rb") : NULL;
            size_t got = f ? fread(&id, 1, sizeof id, f) : 0;
            if (f) fclose(f);
            if (got == sizeof id) break;
            if (stop_requested || peer_lost) fatal("stopped while waiting for rank 0's %s", path);
            if (waited_ms > 600000)
                fatal("no %s from rank 0 after 10 minutes: is the run folder on a file system every rank sees?", path);
            usleep(50000);
        }
    }
    nccl_check(ncclCommInitRank(&team.comm, team.world, id, team.rank));
    if (team.rank == 0 && !rdzv[0]) unlink(path);
    int lowest, highest;  // (the all-reduces at the model's priority, above the update's: gpu_init)
    cuda_check(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
    cuda_check(cudaStreamCreateWithPriority(&team.stream, cudaStreamDefault, highest));
    cuda_check(cudaEventCreateWithFlags(&team.fork, cudaEventDisableTiming));
    cuda_check(cudaEventCreateWithFlags(&team.join, cudaEventDisableTiming));
#endif
}

static void catch_signal(int sig, void (*handler)(int)) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = handler;
    sigaction(sig, &sa, NULL);
}

// SIGINT, SIGTERM and SIGHUP (the terminal or session closed) go to `handler`.
static void catch_signals(void (*handler)(int)) {
    catch_signal(SIGINT, handler);
    catch_signal(SIGTERM, handler);
    catch_signal(SIGHUP, handler);
}

// --gpus N: starts N copies of this command, rank i on GPU i of this machine, with the variables
// torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK) and a job name for the id file, each in a process
// group of its own so that a terminal's Ctrl-C reaches only this process, which passes SIGINT and
// SIGTERM on to all (a second Ctrl-C: they exit at once), and SIGHUP as SIGTERM. Should this
// process die, the ranks get SIGTERM (PR_SET_PDEATHSIG): they stop after a step and save. When one
// fails (an error, a signal), the others get SIGUSR1 (they give up at once: no step can finish)
// and after 15 s SIGKILL. Returns the exit status: 0 when every rank succeeded, else the first
// failure's.
static volatile sig_atomic_t launcher_signal;
static void on_launcher_signal(int sig) { launcher_signal = sig; }

static int launch_gpus(int n, char **argv) {
    pid_t *pids = (pid_t *)malloc_or_die(n * sizeof(pid_t));
    char text[32];
    snprintf(text, sizeof text, "%d", n);
    setenv("WORLD_SIZE", text, 1);
    snprintf(text, sizeof text, "gpus-%d", (int)getpid());
    setenv("TRAIN_UNET_JOB", text, 1);
    catch_signals(on_launcher_signal);
    fflush(NULL);
    pid_t launcher = getpid();
    for (int i = 0; i < n; i++) {
        pids[i] = fork();
        if (pids[i] < 0) fatal("cannot start rank %d: %s", i, strerror(errno));
        if (pids[i] == 0) {
            setpgid(0, 0);
            prctl(PR_SET_PDEATHSIG, SIGTERM);
            if (getppid() != launcher) _exit(1);  // the launcher died before the line above
            snprintf(text, sizeof text, "%d", i);
            setenv("RANK", text, 1);
            setenv("LOCAL_RANK", text, 1);
            execv("/proc/self/exe", argv);
            fprintf(stderr, "%s: error: cannot start rank %d: %s\n", program_name, i, strerror(errno));
            _exit(127);
        }
        setpgid(pids[i], pids[i]);  // also here: whichever of the two runs first
    }
    int alive = n, status = 0;
    double kill_at = 0;
    while (alive > 0) {
        int st;
        pid_t pid = waitpid(-1, &st, WNOHANG);
        if (pid > 0) {
            int rank = 0;
            while (rank < n && pids[rank] != pid) rank++;
            if (rank == n) continue;
            pids[rank] = 0, alive--;
            int failed = WIFSIGNALED(st) ? 128 + WTERMSIG(st) : WEXITSTATUS(st);
            if (failed && !status) {
                status = failed;
                if (alive) {
                    if (WIFSIGNALED(st)) fprintf(stderr, "%s: error: rank %d was killed by signal %d; stopping the other ranks\n",
                                                 program_name, rank, WTERMSIG(st));
                    else fprintf(stderr, "%s: error: rank %d exited with status %d; stopping the other ranks\n", program_name,
                                 rank, failed);
                    for (int i = 0; i < n; i++) if (pids[i]) kill(pids[i], SIGUSR1);
                    kill_at = now_seconds() + 15.0;
                }
            }
            continue;
        }
        if (launcher_signal) {
            int sig = launcher_signal == SIGHUP ? SIGTERM : launcher_signal;
            for (int i = 0; i < n; i++) if (pids[i]) kill(pids[i], sig);
            launcher_signal = 0;
        }
        if (kill_at > 0 && now_seconds() > kill_at)
            for (int i = 0; i < n; i++) if (pids[i]) kill(pids[i], SIGKILL);
        usleep(20000);
    }
    free(pids);
    return status;
}
