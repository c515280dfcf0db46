/* aenv-spawn-as: runs a program as another user, so that envd can start it with vfork.
 *
 * CPython's subprocess forks (copies envd's address space) instead of vforking as soon as
 * the child must switch credentials; in gVisor that fork costs 20-40 ms per command. envd
 * instead vforks this small static program as root, which switches and execs:
 *
 *     aenv-spawn-as UID GID GROUPS ERRFD PROGRAM ARG...
 *
 * GROUPS is a comma-separated list of supplementary group ids ("-" for none). ERRFD is a
 * pipe whose other end envd reads: on success it closes with the exec (close-on-exec) and
 * envd reads nothing; on failure this program writes "STAGE:ERRNO" to it and exits 127, so
 * envd reports the error just as subprocess would have. PROGRAM is looked up on the PATH of
 * the environment it is given, like subprocess does.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_GROUPS 256

static int errfd = -1;

static void fail(const char *stage, int err) {
    char msg[64];
    int n = snprintf(msg, sizeof msg, "%s:%d", stage, err);
    if (errfd >= 0 && n > 0) {
        ssize_t w = write(errfd, msg, (size_t)n);
        (void)w;
    }
    _exit(127);
}

static unsigned long number(const char *s) {
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || *s == '\0' || *end != '\0') fail("usage", EINVAL);
    return v;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fputs("usage: aenv-spawn-as UID GID GROUPS ERRFD PROGRAM [ARG...]\n", stderr);
        return 125;
    }
    errfd = (int)number(argv[4]);
    if (fcntl(errfd, F_SETFD, FD_CLOEXEC) < 0) fail("usage", errno);
    uid_t uid = (uid_t)number(argv[1]);
    gid_t gid = (gid_t)number(argv[2]);

    gid_t groups[MAX_GROUPS];
    size_t ngroups = 0;
    if (strcmp(argv[3], "-") != 0) {
        char *list = argv[3], *tok, *save = NULL;
        for (tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
            if (ngroups == MAX_GROUPS) fail("groups", E2BIG);
            groups[ngroups++] = (gid_t)number(tok);
        }
    }
    /* The order matters: groups and gid while still root, the uid last. */
    if (setgroups(ngroups, groups) < 0) fail("setgroups", errno);
    if (setgid(gid) < 0) fail("setgid", errno);
    if (setuid(uid) < 0) fail("setuid", errno);
    execvp(argv[5], &argv[5]);
    fail("exec", errno);
    return 127;
}
