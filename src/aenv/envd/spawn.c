/* libaenv-spawn: envd starts every command through aenv_spawn(), a vfork that switches
 * credentials in the child itself.
 *
 * CPython's subprocess forks (copies envd's address space: 20-40 ms in gVisor) as soon as
 * the child must change user, and a helper program that switches and execs again costs a
 * second exec (~12 ms in gVisor). Here the child of vfork sets its groups, gid and uid with
 * raw system calls (glibc's wrappers would ask every thread of the parent to switch too:
 * the child shares their memory), takes its descriptors and session, and execs once.
 *
 * Failures in the child are written to `errfd` (close-on-exec, so a successful exec
 * closes it with nothing written) as two ints, the stage and errno, then it exits 127.
 * The caller reads that pipe after aenv_spawn returns: vfork resumes the parent only once
 * the child has exec'd or exited, so the report is complete by then.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <termios.h>
#include <unistd.h>

enum stage {
    ST_FDS = 1,
    ST_SETSID,
    ST_CTTY,
    ST_CHDIR,
    ST_GROUPS,
    ST_GID,
    ST_UID,
    ST_EXEC,
};

__attribute__((noreturn)) static void fail(int errfd, int stage, int err) {
    int msg[2] = {stage, err};
    ssize_t w = write(errfd, msg, sizeof msg);
    (void)w;
    _exit(127);
}

/* Every descriptor from 3 up except `keep` closed: close_range where the kernel has it,
 * else the entries of /proc/self/fd read with raw getdents64 (no allocation in the child). */
static void close_others(int keep) {
    if (syscall(SYS_close_range, 3, keep - 1, 0) == 0 &&
        syscall(SYS_close_range, keep + 1, ~0U, 0) == 0)
        return;
    int dir = (int)syscall(SYS_open, "/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) return;
    char buf[4096];
    long n;
    while ((n = syscall(SYS_getdents64, dir, buf, sizeof buf)) > 0) {
        for (long off = 0; off < n;) {
            struct dirent64 *d = (struct dirent64 *)(buf + off);
            off += d->d_reclen;
            int fd = 0;
            const char *p = d->d_name;
            if (*p < '0' || *p > '9') continue;
            for (; *p >= '0' && *p <= '9'; p++) fd = fd * 10 + (*p - '0');
            if (fd >= 3 && fd != keep && fd != dir) close(fd);
        }
    }
    close(dir);
}

/* `fd` as descriptor `target`, inheritable. */
static int move_to(int fd, int target) {
    if (fd == target) {
        int flags = fcntl(fd, F_GETFD);
        return flags < 0 ? -1 : fcntl(fd, F_SETFD, flags & ~FD_CLOEXEC);
    }
    return dup2(fd, target) < 0 ? -1 : 0;
}

__attribute__((noreturn)) static void child(char *const paths[], char *const argv[], char *const envp[], const char *cwd,
                  int fds[3], int ctty, long uid, long gid, int ngroups, const gid_t *groups,
                  int file_mask, int errfd, const sigset_t *mask) {
    /* Handlers are the child's own copy (no CLONE_SIGHAND): back to the defaults, and
     * SIGPIPE/SIGXFSZ too, which Python ignores and a program expects at default. */
    for (int sig = 1; sig < NSIG; sig++) {
        struct sigaction sa;
        if (sig == SIGKILL || sig == SIGSTOP) continue;
        if (sigaction(sig, NULL, &sa) != 0) continue;
        if (sa.sa_handler != SIG_DFL && (sa.sa_handler != SIG_IGN || sig == SIGPIPE ||
                                         sig == SIGXFSZ)) {
            memset(&sa, 0, sizeof sa);
            sa.sa_handler = SIG_DFL;
            sigaction(sig, &sa, NULL);
        }
    }
    sigprocmask(SIG_SETMASK, mask, NULL);
    /* A descriptor already below 3 but not in its place is moved up first, so placing
     * the others cannot overwrite it. */
    for (int i = 0; i < 3; i++)
        if (fds[i] >= 0 && fds[i] < 3 && fds[i] != i) {
            fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 3);
            if (fds[i] < 0) fail(errfd, ST_FDS, errno);
        }
    for (int i = 0; i < 3; i++)
        if (fds[i] >= 0 && move_to(fds[i], i) != 0) fail(errfd, ST_FDS, errno);
    close_others(errfd);
    if (setsid() < 0) fail(errfd, ST_SETSID, errno);
    if (ctty && ioctl(0, TIOCSCTTY, 0) < 0) fail(errfd, ST_CTTY, errno);
    if (cwd && chdir(cwd) < 0) fail(errfd, ST_CHDIR, errno);
    if (file_mask >= 0) umask((mode_t)file_mask);
    if (uid >= 0) {
        /* Groups and gid while still root, the uid last. */
        if (syscall(SYS_setgroups, ngroups, groups) < 0) fail(errfd, ST_GROUPS, errno);
        if (syscall(SYS_setresgid, gid, gid, gid) < 0) fail(errfd, ST_GID, errno);
        if (syscall(SYS_setresuid, uid, uid, uid) < 0) fail(errfd, ST_UID, errno);
    }
    /* Each candidate in turn, as subprocess walks PATH: the first error that is not
     * "not there" is the one reported. */
    int saved = 0;
    for (int i = 0; paths[i]; i++) {
        execve(paths[i], argv, envp);
        if (errno != ENOENT && errno != ENOTDIR && saved == 0) saved = errno;
    }
    fail(errfd, ST_EXEC, saved ? saved : errno);
}

/* Starts argv with the first of `paths` that execs. `fds` are the child's 0, 1, 2 (-1:
 * inherited); `ctty`: fd 0 is a terminal to make the controlling one; `uid` -1: no switch;
 * `file_mask` -1: the umask inherited. Returns the pid, or -1 with errno when vfork itself
 * failed. */
pid_t aenv_spawn(char *const paths[], char *const argv[], char *const envp[], const char *cwd,
                 int in_fd, int out_fd, int err_fd, int ctty, long uid, long gid, int ngroups,
                 const gid_t *groups, int file_mask, int errfd) {
    int fds[3] = {in_fd, out_fd, err_fd};
    sigset_t all, old;
    sigfillset(&all);
    /* No handler of the parent may run in the child between vfork and exec. */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid_t pid = vfork();
    if (pid == 0)
        child(paths, argv, envp, cwd, fds, ctty, uid, gid, ngroups, groups, file_mask, errfd,
              &old);
    int err = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    errno = err;
    return pid;
}
