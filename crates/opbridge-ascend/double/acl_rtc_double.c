/* libacl_rtc.so of the opbridge ACL double: the runtime compiler (aclrtc, notes §1.12) for the
 * double's test-only kernel dialect (acldouble_kernel.h, installed beside this library). A
 * "compile" runs the system compiler ($CC, else cc) on the program's C source and keeps the
 * shared object it makes as the program's binary (what aclrtBinaryLoadFromData then loads).
 * Like aclrtc, it needs no aclInit. Error codes: 176000 invalid program, 176001 invalid input,
 * 176002 invalid option, 176003 compilation error, 276001 out of memory, 576000 internal. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <pthread.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
typedef int aclError;
typedef void *aclrtcProg;

#define RTC_INVALID_PROG 176000
#define RTC_INVALID_INPUT 176001
#define RTC_INVALID_OPTION 176002
#define RTC_COMPILATION 176003
#define RTC_OUT_OF_MEMORY 276001
#define RTC_FAILURE 576000
#define MAX_OPTIONS 64

extern char **environ;

typedef struct prog {
    char *src;
    char name[128];
    char *bin;
    size_t bin_size;
    char *log;
    struct prog *next;
} prog;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static prog *g_progs;

static int live(const prog *p) { /* g_lock held */
    for (prog *x = g_progs; x; x = x->next)
        if (x == p) return 1;
    return 0;
}

static void set_log(prog *p, const char *text) {
    free(p->log);
    p->log = strdup(text ? text : "");
}

EXPORT aclError aclrtcCreateProg(aclrtcProg *out, const char *src, const char *name, int numHeaders,
                                 const char **headers, const char **includeNames) {
    if (!out || !src) return RTC_INVALID_INPUT;
    if (numHeaders != 0 || headers || includeNames) return RTC_INVALID_INPUT; /* "currently must be 0" */
    prog *p = calloc(1, sizeof *p);
    if (!p || !(p->src = strdup(src))) {
        free(p);
        return RTC_OUT_OF_MEMORY;
    }
    /* the file name the compiler's messages show: letters, digits and '_' only */
    const char *n = name && *name ? name : "default_program";
    size_t k = 0;
    for (; n[k] && k + 1 < sizeof p->name; k++)
        p->name[k] = (n[k] == '_' || (n[k] >= '0' && n[k] <= '9') || ((n[k] | 32) >= 'a' && (n[k] | 32) <= 'z')) ? n[k]
                                                                                                             : '_';
    p->log = strdup("");
    pthread_mutex_lock(&g_lock);
    p->next = g_progs;
    g_progs = p;
    pthread_mutex_unlock(&g_lock);
    *out = p;
    return 0;
}

EXPORT aclError aclrtcDestroyProg(aclrtcProg *handle) {
    if (!handle) return RTC_INVALID_INPUT;
    pthread_mutex_lock(&g_lock);
    prog *p = *handle;
    int ok = live(p);
    if (ok) {
        prog **pp = &g_progs;
        while (*pp != p) pp = &(*pp)->next;
        *pp = p->next;
    }
    pthread_mutex_unlock(&g_lock);
    if (!ok) return RTC_INVALID_PROG;
    free(p->src);
    free(p->bin);
    free(p->log);
    free(p);
    *handle = NULL;
    return 0;
}

/* The whole of a file, NUL-terminated (NULL on failure). */
static char *slurp(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n + 4096 + 1 > cap) {
            cap = (n + 4096 + 1) * 2;
            char *grown = realloc(buf, cap);
            if (!grown) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = grown;
        }
        size_t got = fread(buf + n, 1, 4096, f);
        n += got;
        if (got < 4096) break;
    }
    fclose(f);
    buf[n] = 0;
    if (size) *size = n;
    return buf;
}

/* The folder of this library (where acldouble_kernel.h is installed). */
static void own_folder(char *out, size_t cap) {
    Dl_info info;
    out[0] = 0;
    if (dladdr((void *)aclrtcCreateProg, &info) && info.dli_fname) {
        char copy[4096];
        snprintf(copy, sizeof copy, "%s", info.dli_fname);
        snprintf(out, cap, "%s", dirname(copy));
    }
}

EXPORT aclError aclrtcCompileProg(aclrtcProg handle, int numOptions, const char **options) {
    pthread_mutex_lock(&g_lock);
    int ok = live(handle);
    pthread_mutex_unlock(&g_lock);
    if (!ok) return RTC_INVALID_PROG;
    prog *p = handle;
    if (numOptions < 0 || numOptions > MAX_OPTIONS || (numOptions && !options)) return RTC_INVALID_INPUT;
    /* Options: exactly one --npu-arch=dav-NNNN (aclrtc compiles for one architecture), -D
     * definitions, -O levels, -g. Anything else is refused (the double does not pass arbitrary
     * flags to the system compiler). */
    const char *argv[MAX_OPTIONS + 16];
    int argc = 0, arch = 0;
    const char *cc = getenv("CC");
    argv[argc++] = cc && *cc && !strchr(cc, ' ') ? cc : "cc";
    argv[argc++] = "-std=c11";
    argv[argc++] = "-O2";
    argv[argc++] = "-fPIC";
    argv[argc++] = "-shared";
    for (int i = 0; i < numOptions; i++) {
        const char *o = options[i];
        if (!o) return RTC_INVALID_INPUT;
        if (!strncmp(o, "--npu-arch=dav-", 15) && o[15] && strspn(o + 15, "0123456789") == strlen(o + 15)) {
            arch++;
        } else if ((!strncmp(o, "-D", 2) && o[2] && o[2] != '-') || !strcmp(o, "-g") ||
                   (!strncmp(o, "-O", 2) && strlen(o) == 3 && strchr("0123s", o[2]))) {
            argv[argc++] = o;
        } else {
            char text[512];
            snprintf(text, sizeof text, "unsupported option '%s' (the double takes --npu-arch=dav-N, -D, -O, -g)", o);
            set_log(p, text);
            return RTC_INVALID_OPTION;
        }
    }
    if (arch != 1) {
        set_log(p, "exactly one --npu-arch=dav-N option is needed (e.g. --npu-arch=dav-2201)");
        return RTC_INVALID_OPTION;
    }
    char folder[4096], include[4200], dir[] = "/tmp/acldouble-rtc-XXXXXX";
    own_folder(folder, sizeof folder);
    snprintf(include, sizeof include, "-I%s", folder);
    if (!mkdtemp(dir)) return RTC_FAILURE;
    char src_path[256], out_path[256], log_path[256];
    snprintf(src_path, sizeof src_path, "%s/%s.c", dir, p->name);
    snprintf(out_path, sizeof out_path, "%s/kernel.so", dir);
    snprintf(log_path, sizeof log_path, "%s/log.txt", dir);
    aclError rc = 0;
    FILE *f = fopen(src_path, "w");
    if (!f || fputs(p->src, f) < 0) rc = RTC_FAILURE;
    if (f) fclose(f);
    argv[argc++] = include;
    argv[argc++] = "-o";
    argv[argc++] = out_path;
    argv[argc++] = src_path;
    argv[argc] = NULL;
    if (!rc) {
        posix_spawn_file_actions_t actions;
        posix_spawn_file_actions_init(&actions);
        posix_spawn_file_actions_addopen(&actions, 1, log_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        posix_spawn_file_actions_adddup2(&actions, 1, 2);
        pid_t pid;
        int status = 0;
        if (posix_spawnp(&pid, argv[0], &actions, NULL, (char *const *)argv, environ) != 0) {
            char text[512];
            snprintf(text, sizeof text, "cannot run the compiler %s: %s", argv[0], strerror(errno));
            set_log(p, text);
            rc = RTC_FAILURE;
        } else {
            while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
            }
            char *log = slurp(log_path, NULL);
            set_log(p, log);
            free(log);
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = RTC_COMPILATION;
        }
        posix_spawn_file_actions_destroy(&actions);
    }
    if (!rc) {
        size_t size = 0;
        char *bin = slurp(out_path, &size);
        if (!bin) {
            rc = RTC_FAILURE;
        } else {
            free(p->bin);
            p->bin = bin;
            p->bin_size = size;
        }
    }
    unlink(src_path);
    unlink(out_path);
    unlink(log_path);
    rmdir(dir);
    return rc;
}

static prog *checked(aclrtcProg handle) {
    pthread_mutex_lock(&g_lock);
    int ok = live(handle);
    pthread_mutex_unlock(&g_lock);
    return ok ? handle : NULL;
}

EXPORT aclError aclrtcGetBinDataSize(aclrtcProg handle, size_t *size) {
    prog *p = checked(handle);
    if (!p) return RTC_INVALID_PROG;
    if (!size || !p->bin) return RTC_INVALID_INPUT; /* not compiled (successfully) */
    *size = p->bin_size;
    return 0;
}

EXPORT aclError aclrtcGetBinData(aclrtcProg handle, char *data) {
    prog *p = checked(handle);
    if (!p) return RTC_INVALID_PROG;
    if (!data || !p->bin) return RTC_INVALID_INPUT;
    memcpy(data, p->bin, p->bin_size);
    return 0;
}

EXPORT aclError aclrtcGetCompileLogSize(aclrtcProg handle, size_t *size) {
    prog *p = checked(handle);
    if (!p) return RTC_INVALID_PROG;
    if (!size) return RTC_INVALID_INPUT;
    *size = strlen(p->log) + 1;
    return 0;
}

EXPORT aclError aclrtcGetCompileLog(aclrtcProg handle, char *log) {
    prog *p = checked(handle);
    if (!p) return RTC_INVALID_PROG;
    if (!log) return RTC_INVALID_INPUT;
    memcpy(log, p->log, strlen(p->log) + 1);
    return 0;
}
