// test_rendezvous.cu: the TCP rendezvous of many-GPU runs (team.cuh's rendezvous_tcp, which
// torchrun-style launches use through MASTER_ADDR and MASTER_PORT, or --rdzv), without a GPU: ranks
// as processes on this machine. Every rank gets rank 0's id; a rank with another WORLD_SIZE or
// configuration, a rank that never arrives, a port in use and a rank 0 that is not there each stop
// with one line naming the problem, in bounded time; after meeting, a rank that ends without its
// clean end is named by the others (the links kept from the rendezvous). And the host:port parser. Where PyTorch is
// installed, the same through torchrun's agent store (rendezvous_store) against PyTorch's own
// TCPStore server, and this program's ranks started by torchrun itself in its common forms (the
// rendezvous only: no GPU); without it those cases are skipped with one line.
#define TRAIN_UNET_LIBRARY
#include "../../train_unet.cu"
#include "check.h"

// A port no socket listens on now (the kernel's choice for port 0).
static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET, a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &len) != 0) return -1;
    close(fd);
    return ntohs(a.sin_port);
}

// A socket listening on port of address (INADDR_ANY, INADDR_LOOPBACK), or -1.
static int listening_socket(int port, uint32_t address) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET, a.sin_addr.s_addr = htonl(address), a.sin_port = htons((uint16_t)port);
    if (fd >= 0 && (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 1) != 0)) close(fd), fd = -1;
    return fd;
}

typedef struct {
    int rank, world;
    int store;  // through a TCPStore (rendezvous_store), not rank 0's port
    int stopped;  // asked to stop before it starts
    char config[128];
    int then;  // after meeting: 0 end at once (the links closed without a clean end), THEN_LEAVE team_leave
               // first, THEN_WATCH team_lost_rank for up to 10 s (then team_leave, when none was lost)
    pid_t pid;
    int pipe;  // the child's result: its return value, its payload, its error line
} Rank;

enum { THEN_LEAVE = 1, THEN_WATCH = 2 };

typedef struct {
    int result;
    int lost;  // THEN_WATCH: the rank team_lost_rank named (-1: none)
    uint8_t payload[16];
    char err[600];
} Outcome;

// Starts a rank in a child process: rendezvous_tcp on 127.0.0.1:port, rank 0 offering a payload of 16 bytes.
static void start(Rank *r, int port, double timeout_s) {
    int fds[2];
    if (pipe(fds) != 0) return;
    fflush(NULL);
    r->pid = fork();
    if (r->pid == 0) {
        close(fds[0]);
        Outcome o;
        memset(&o, 0, sizeof o);
        if (r->rank == 0)
            for (int i = 0; i < 16; i++) o.payload[i] = (uint8_t)(i * 7 + 1);
        stop_requested = r->stopped;
        team.rank = r->rank, team.world = r->world;
        o.result = (r->store ? rendezvous_store : rendezvous_tcp)("127.0.0.1", port, r->rank, r->world, r->config, timeout_s, o.payload,
                                                                 sizeof o.payload, o.err, sizeof o.err);
        o.lost = -1;
        for (double t0 = now_seconds(); o.result == 0 && r->then == THEN_WATCH && o.lost < 0 && now_seconds() - t0 < 10; usleep(1000))
            o.lost = team_lost_rank();
        if (o.result == 0 && r->then != 0 && o.lost < 0) team_leave();
        ssize_t written = write(fds[1], &o, sizeof o);
        _exit(written == (ssize_t)sizeof o ? 0 : 3);
    }
    close(fds[1]);
    r->pipe = fds[0];
}

static Outcome finish(Rank *r) {
    Outcome o;
    memset(&o, 0, sizeof o);
    o.result = 99;
    size_t got = 0;
    ssize_t n;
    while (got < sizeof o && (n = read(r->pipe, (char *)&o + got, sizeof o - got)) > 0) got += (size_t)n;
    close(r->pipe);
    waitpid(r->pid, NULL, 0);
    return o;
}

static int payload_is_rank_0s(const Outcome *o) {
    for (int i = 0; i < 16; i++)
        if (o->payload[i] != (uint8_t)(i * 7 + 1)) return 0;
    return 1;
}

static const char *config = "parameters 1000; batch_size 8; dataset 300 images of 32x32";

static void make_ranks(Rank *ranks, int count, int world, int store = 0) {
    for (int i = 0; i < count; i++) {
        ranks[i].rank = i, ranks[i].world = world, ranks[i].store = store, ranks[i].stopped = 0, ranks[i].then = 0;
        snprintf(ranks[i].config, sizeof ranks[i].config, "%s", config);
    }
}

// PyTorch's TCPStore server on port (as torchrun's agent holds one), in a child process until it is
// killed; returns its pid once it accepts connections, or -1 without PyTorch (the child ends) or
// when it does not start within 60 s.
static pid_t store_server(int port) {
    char command[512];
    snprintf(command, sizeof command, "exec python3 -c 'import time\nfrom torch.distributed import TCPStore\n"
             "s = TCPStore(\"127.0.0.1\", %d, is_master=True, wait_for_workers=False)\ntime.sleep(600)' >/dev/null 2>&1", port);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", command, (char *)NULL);
        _exit(127);
    }
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET, a.sin_addr.s_addr = htonl(INADDR_LOOPBACK), a.sin_port = htons((uint16_t)port);
    int ended = pid < 0;
    for (double t0 = now_seconds(); !ended && now_seconds() - t0 < 60; usleep(100000)) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        int up = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
        if (fd >= 0) close(fd);
        if (up) return pid;
        ended = waitpid(pid, NULL, WNOHANG) != 0;
    }
    if (!ended) kill(pid, SIGKILL), waitpid(pid, NULL, 0);
    return -1;
}

// As one rank under a real launcher (build/test/test_rendezvous --as-rank, started by torchrun, mpirun
// or a Slurm-like environment): the
// rendezvous its environment gives (team_from_environment, rendezvous_from_environment), rank 0
// offering 16 bytes of its own; prints "rank R/W restart N: met X Y" (the bytes' first two) or the
// error line. With FAIL_FIRST set, rank 1 ends with status 3 after its first meeting (restart
// count 0), so that torchrun restarts every worker.
static int as_launched_rank(void) {
    Team t = {0, 1, 0, NULL, NULL, NULL, NULL};
    if (!team_from_environment(&t)) return printf("no launcher's variables\n"), 1;
    char rdzv[300], host[256], err[1024];
    int agent_store;
    rendezvous_from_environment("", rdzv, sizeof rdzv, &agent_store);
    int port = rendezvous_address(rdzv, host, sizeof host);
    const char *restart = getenv("TORCHELASTIC_RESTART_COUNT");
    uint8_t id[16] = {0};
    for (int i = 0; i < 16 && t.rank == 0; i++) id[i] = (uint8_t)(getpid() + i);
    int r = port < 0 ? error_line(err, sizeof err, "no rendezvous address") : (agent_store ? rendezvous_store : rendezvous_tcp)(
                host, port, t.rank, t.world, config, 60, id, sizeof id, err, sizeof err);
    if (r == 0) printf("rank %d/%d restart %s: met %d %d\n", t.rank, t.world, restart ? restart : "-", id[0], id[1]);
    else printf("rank %d/%d restart %s: %s\n", t.rank, t.world, restart ? restart : "-", err);
    if (getenv("FAIL_FIRST") && restart && strcmp(restart, "0") == 0 && t.rank == 1) return 3;
    return r == 0 ? 0 : 1;
}

// Runs a launcher's command line (its own output dropped) whose workers are this program as ranks,
// and checks what they print: `world` lines "met" with one pair of bytes, at restart `restart` ("-"
// without torchrun's count).
static void check_launched(const char *command, int world, const char *restart) {
    FILE *p = popen(command, "r");
    char line[1200], met[64] = "", want[32];
    int count = 0, same = 1;
    snprintf(want, sizeof want, "restart %s: met ", restart);
    while (p && fgets(line, sizeof line, p)) {
        const char *at = strstr(line, want);
        if (!at) {
            if (strstr(line, "restart ") && !strstr(line, ": met ")) printf("  %s", line);  // a rank's error line
            continue;
        }
        if (count++ == 0) snprintf(met, sizeof met, "%s", at);
        else same &= strcmp(met, at) == 0;
    }
    int status = p ? pclose(p) : -1;
    if (count != world || !same || status != 0) printf("  %s: %d of %d ranks met at restart %s, exit status %d\n", command, count, world, restart, status);
    CHECK(count == world && same && status == 0);
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--as-rank") == 0) return as_launched_rank();
    char host[256];
    check_case("host:port: a name, an address, an IPv6 address in brackets; no port, port 0 or past 65535 refused");
    CHECK(rendezvous_address("node-1:29500", host, sizeof host) == 29500 && strcmp(host, "node-1") == 0);
    CHECK(rendezvous_address("10.0.0.2:1", host, sizeof host) == 1 && strcmp(host, "10.0.0.2") == 0);
    CHECK(rendezvous_address("[::1]:65535", host, sizeof host) == 65535 && strcmp(host, "::1") == 0);
    CHECK(rendezvous_address("node-1", host, sizeof host) < 0 && rendezvous_address("node-1:", host, sizeof host) < 0);
    CHECK(rendezvous_address(":29500", host, sizeof host) < 0 && rendezvous_address("node-1:0", host, sizeof host) < 0);
    CHECK(rendezvous_address("node-1:65536", host, sizeof host) < 0 && rendezvous_address("node-1:29x", host, sizeof host) < 0);

    check_case("host:port: a sign or space in the port, an unclosed or empty bracket, a bare IPv6 address, junk refused");
    const char *bad[] = {"host: 80", "host:+80", "host:-80", "host:80 ", "host:0x50", "host:000080", "host:", "[::1:80", "a:b:c:80",
                         "[]:80", "::1:80", "[node-1]:80", "[::1]]:80", "[::1]x:80", "]:80", "host name:80", "host!:80", "[::1%]:80",
                         "[::g]:80", ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        if (rendezvous_address(bad[i], host, sizeof host) >= 0) printf("  '%s' was taken\n", bad[i]), check_case_failed = 1;
    CHECK(rendezvous_address("[fe80::1%eth0]:29500", host, sizeof host) == 29500 && strcmp(host, "fe80::1%eth0") == 0);
    CHECK(rendezvous_address("[::ffff:10.0.0.2]:80", host, sizeof host) == 80 && strcmp(host, "::ffff:10.0.0.2") == 0);
    CHECK(rendezvous_address("node_1.example.com:080", host, sizeof host) == 80 && strcmp(host, "node_1.example.com") == 0);
    CHECK(rendezvous_port("1") == 1 && rendezvous_port("65535") == 65535 && rendezvous_port("70000") < 0 && rendezvous_port("0") < 0);
    CHECK(rendezvous_port("-1") < 0 && rendezvous_port("abc") < 0 && rendezvous_port("") < 0 && rendezvous_port(" 80") < 0);

    check_case("four ranks meet: every one gets rank 0's id, whichever comes first");
    {
        int port = free_port();
        Rank ranks[4];
        make_ranks(ranks, 4, 4);
        for (int i = 3; i >= 0; i--) start(&ranks[i], port, 30);  // the others before rank 0 listens: they try again
        for (int i = 0; i < 4; i++) {
            Outcome o = finish(&ranks[i]);
            if (o.result != 0) printf("  rank %d: %s\n", i, o.err);
            CHECK(o.result == 0 && payload_is_rank_0s(&o));
        }
    }

    check_case("after meeting, a rank that ends without its clean end is named by the others (rank 0 by its link, the rest by rank 0)");
    {
        int port = free_port();
        Rank ranks[3];
        make_ranks(ranks, 3, 3);
        ranks[0].then = ranks[1].then = THEN_WATCH;
        for (int i = 0; i < 3; i++) start(&ranks[i], port, 30);
        Outcome zero = finish(&ranks[0]), one = finish(&ranks[1]), two = finish(&ranks[2]);
        CHECK(zero.result == 0 && one.result == 0 && two.result == 0);
        CHECK(zero.lost == 2 && one.lost == 2);
    }

    check_case("after meeting, a rank's clean end (team_leave) is no loss: the others watch 10 s and name none");
    {
        int port = free_port();
        Rank ranks[3];
        make_ranks(ranks, 3, 3);
        ranks[0].then = ranks[1].then = THEN_WATCH, ranks[2].then = THEN_LEAVE;
        for (int i = 0; i < 3; i++) start(&ranks[i], port, 30);
        Outcome zero = finish(&ranks[0]), one = finish(&ranks[1]), two = finish(&ranks[2]);
        CHECK(zero.result == 0 && one.result == 0 && two.result == 0);
        CHECK(zero.lost == -1 && one.lost == -1);
    }

    check_case("a rank with another WORLD_SIZE stops the team with one line naming it");
    {
        int port = free_port();
        Rank ranks[3];
        make_ranks(ranks, 3, 3);
        ranks[2].world = 4;
        start(&ranks[0], port, 5), start(&ranks[2], port, 5);
        Outcome zero = finish(&ranks[0]), two = finish(&ranks[2]);
        CHECK(zero.result == -1 && strstr(zero.err, "rendezvous: rank 2 has WORLD_SIZE 4, rank 0 3"));
        CHECK(two.result == -1 && strcmp(two.err, zero.err) == 0);
    }

    check_case("a rank of another configuration stops the team, the first difference named");
    {
        int port = free_port();
        Rank ranks[2];
        make_ranks(ranks, 2, 2);
        snprintf(ranks[1].config, sizeof ranks[1].config, "parameters 1000; batch_size 16; dataset 300 images of 32x32");
        start(&ranks[0], port, 5), start(&ranks[1], port, 5);
        Outcome zero = finish(&ranks[0]), one = finish(&ranks[1]);
        CHECK(zero.result == -1 && strstr(zero.err, "rank 1's configuration differs from rank 0's: batch_size 16 against batch_size 8"));
        CHECK(one.result == -1 && strcmp(one.err, zero.err) == 0);
    }

    check_case("a rank that never arrives: rank 0 stops after the timeout naming it, and tells the ranks that came");
    {
        int port = free_port();
        Rank ranks[2];
        make_ranks(ranks, 2, 3);
        double t0 = now_seconds();
        start(&ranks[0], port, 2), start(&ranks[1], port, 2);
        Outcome zero = finish(&ranks[0]), one = finish(&ranks[1]);
        CHECK(zero.result == -1 && strstr(zero.err, "2 never arrived at port") && strstr(zero.err, "within 2 s"));
        CHECK(one.result == -1 && strcmp(one.err, zero.err) == 0);
        CHECK(now_seconds() - t0 < 20);
    }

    check_case("a port in use, and a rank 0 that is not there: one line each, in bounded time");
    {
        int port = free_port(), busy = listening_socket(port, INADDR_ANY);
        CHECK(busy >= 0);
        Rank ranks[2];
        make_ranks(ranks, 2, 2);
        start(&ranks[0], port, 2);
        Outcome zero = finish(&ranks[0]);
        CHECK(zero.result == -1 && strstr(zero.err, "is in use on this machine: choose another"));
        close(busy);
        int nobody = free_port();
        double t0 = now_seconds();
        start(&ranks[1], nobody, 1);
        Outcome one = finish(&ranks[1]);
        CHECK(one.result == -1 && strstr(one.err, "rendezvous: rank 1 cannot reach rank 0 at 127.0.0.1:") && strstr(one.err, "within 1 s"));
        CHECK(now_seconds() - t0 < 20);
    }

    check_case("a rank 0 that stops before answering, and a rank that is stopped: each says so at once, not after the timeout");
    {
        int port = free_port(), listener = listening_socket(port, INADDR_LOOPBACK);
        CHECK(listener >= 0);
        Rank ranks[2];
        make_ranks(ranks, 2, 2);
        double t0 = now_seconds();
        start(&ranks[1], port, 30);
        int fd = accept(listener, NULL, NULL);  // a rank 0 that takes the hello and ends
        char hello[8];
        CHECK(fd >= 0 && read(fd, hello, sizeof hello) == (ssize_t)sizeof hello);
        close(fd), close(listener);
        Outcome one = finish(&ranks[1]);
        CHECK(one.result == -1 && strstr(one.err, "closed the connection before answering rank 1 (it stopped)") && now_seconds() - t0 < 10);
        ranks[1].stopped = 1;
        start(&ranks[1], free_port(), 30);
        one = finish(&ranks[1]);
        CHECK(one.result == -1 && strstr(one.err, "rendezvous: rank 1 stopped while reaching rank 0") && now_seconds() - t0 < 10);
    }

    int port = free_port();
    pid_t server = store_server(port);
    if (server < 0) printf("skipped: torchrun's agent store (PyTorch's TCPStore) cases: no python3 with torch here\n");
    else {
        check_case("torchrun's agent store (PyTorch's TCPStore): four ranks meet through it, whichever comes first; a restart afresh");
        setenv("TORCHELASTIC_RUN_ID", "test", 1);
        for (int restart = 0; restart < 2; restart++) {
            setenv("TORCHELASTIC_RESTART_COUNT", restart ? "1" : "0", 1);
            Rank ranks[4];
            make_ranks(ranks, 4, 4, 1);
            for (int i = 3; i >= 0; i--) start(&ranks[i], port, 30);
            for (int i = 0; i < 4; i++) {
                Outcome o = finish(&ranks[i]);
                if (o.result != 0) printf("  restart %d, rank %d: %s\n", restart, i, o.err);
                CHECK(o.result == 0 && payload_is_rank_0s(&o));
            }
        }

        check_case("torchrun's agent store: another configuration or WORLD_SIZE stops the team naming it; a missing rank is named");
        setenv("TORCHELASTIC_RESTART_COUNT", "2", 1);
        Rank ranks[3];
        make_ranks(ranks, 3, 3, 1);
        snprintf(ranks[1].config, sizeof ranks[1].config, "parameters 1000; batch_size 16; dataset 300 images of 32x32");
        ranks[2].world = 4;
        for (int i = 0; i < 3; i++) start(&ranks[i], port, 30);
        Outcome outcomes[3];
        for (int i = 0; i < 3; i++) outcomes[i] = finish(&ranks[i]);
        CHECK(outcomes[0].result == -1 && strstr(outcomes[0].err, "rank 1's configuration differs from rank 0's: batch_size 16 against batch_size 8"));
        CHECK(outcomes[1].result == -1 && outcomes[2].result == -1 && strcmp(outcomes[1].err, outcomes[0].err) == 0);
        setenv("TORCHELASTIC_RESTART_COUNT", "3", 1);
        make_ranks(ranks, 2, 3, 1);
        double t0 = now_seconds();
        start(&ranks[0], port, 2), start(&ranks[1], port, 2);
        Outcome zero = finish(&ranks[0]), one = finish(&ranks[1]);
        // (rank 1 is named too when it came after the 2 s: "rank 1, 2 never arrived")
        CHECK(zero.result == -1 && strstr(zero.err, "2 never arrived in torchrun's store within 2 s"));
        CHECK(one.result == -1 && strcmp(one.err, zero.err) == 0 && now_seconds() - t0 < 20);

        check_case("torchrun's agent store: a rank that is stopped says so; a store that is not there is named, in bounded time");
        setenv("TORCHELASTIC_RESTART_COUNT", "4", 1);
        make_ranks(ranks, 2, 2, 1);
        ranks[1].stopped = 1;
        start(&ranks[1], port, 30);
        one = finish(&ranks[1]);
        CHECK(one.result == -1 && strstr(one.err, "rendezvous: rank 1 stopped while"));
        kill(server, SIGKILL), waitpid(server, NULL, 0);
        t0 = now_seconds();
        ranks[1].stopped = 0;
        start(&ranks[1], port, 1);
        one = finish(&ranks[1]);
        CHECK(one.result == -1 && strstr(one.err, "cannot reach torchrun's store at 127.0.0.1:") && now_seconds() - t0 < 20);
    }

    char self[4096], command[2 * sizeof self + 1024];  // this program, whose ranks the launchers start
    ssize_t self_len = readlink("/proc/self/exe", self, sizeof self - 1);
    self[self_len > 0 ? self_len : 0] = '\0';
    if (system("torchrun --help >/dev/null 2>&1") != 0) printf("skipped: torchrun's cases: no torchrun here\n");
    else {
        unsetenv("TORCHELASTIC_RUN_ID"), unsetenv("TORCHELASTIC_RESTART_COUNT");
        check_case("torchrun: --standalone, and --master_addr/--master_port: the workers meet through its agent store");
        snprintf(command, sizeof command, "torchrun --standalone --nproc_per_node 3 --no-python %s --as-rank 2>/dev/null", self);
        check_launched(command, 3, "0");
        snprintf(command, sizeof command, "torchrun --nnodes 1 --master_addr 127.0.0.1 --master_port %d --nproc_per_node 2 --no-python %s "
                 "--as-rank 2>/dev/null", free_port(), self);
        check_launched(command, 2, "0");

        check_case("torchrun: two nodes of two workers on this machine (its c10d rendezvous backend) meet as one team of four");
        int endpoint = free_port();
        snprintf(command, sizeof command, "(torchrun --nnodes 2 --node_rank 1 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint "
                 "127.0.0.1:%d --rdzv-id nodes --no-python %s --as-rank 2>/dev/null &); torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 "
                 "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:%d --rdzv-id nodes --no-python %s --as-rank 2>/dev/null",
                 endpoint, self, endpoint, self);
        check_launched(command, 4, "0");

        check_case("torchrun --max-restarts 1: a worker that fails is restarted with the others, and they meet afresh");
        snprintf(command, sizeof command, "FAIL_FIRST=1 torchrun --standalone --nproc_per_node 3 --max-restarts 1 --no-python %s --as-rank "
                 "2>/dev/null", self);
        check_launched(command, 3, "1");
    }

    if (system("mpirun --version >/dev/null 2>&1") != 0) printf("skipped: mpirun's case: no mpirun (Open MPI) here\n");
    else {
        check_case("mpirun (Open MPI): three ranks, MASTER_ADDR and MASTER_PORT exported with -x, meet over TCP");
        snprintf(command, sizeof command, "MASTER_ADDR=127.0.0.1 MASTER_PORT=%d mpirun --allow-run-as-root --oversubscribe -np 3 -x MASTER_ADDR "
                 "-x MASTER_PORT %s --as-rank 2>/dev/null", free_port(), self);
        check_launched(command, 3, "-");
    }

    check_case("srun's variables (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID) as srun sets them: three ranks meet over TCP");
    snprintf(command, sizeof command, "for r in 0 1 2; do SLURM_PROCID=$r SLURM_STEP_NUM_TASKS=3 SLURM_LOCALID=$r SLURM_JOB_ID=7 "
             "SLURM_STEP_ID=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=%d %s --as-rank & done; wait", free_port(), self);
    check_launched(command, 3, "-");

    check_case_end();
    printf("%d passed, %d failed\n", check_cases_passed, check_cases_failed);
    return check_cases_failed ? 1 : 0;
}
