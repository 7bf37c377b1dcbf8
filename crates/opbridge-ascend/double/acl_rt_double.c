/* opbridge Ascend test double: a strict, host-only stand-in for libacl_rt_impl.so.
 * See README.md in this folder for every behaviour, env knob and the double-only checks. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "acl_decls.h"
#include "double_internal.h"

#define EXPORT __attribute__((visibility("default")))
#define ALIGN_UP(x, a) (((x) + ((a)-1)) / (a) * (a))
#define MAX_DEVICES 64
#define MAX_STREAMS_PER_DEVICE 1984 /* including the default stream (notes §3) */
#define MAX_EVENTS_PER_DEVICE 65536
#define MSG_CAP 8192

/* ------------------------------------------------------------------ config */
typedef struct {
    char func[64];
    uint64_t n;
    int code; /* 0 = natural code */
    uint64_t calls;
} fail_rule;

static struct {
    int device_count;
    size_t memory_bytes;
    char soc[64];
    double copy_gbps;
    long launch_us;
    int compat;
    char report_file[1024];
    fail_rule rules[64];
    int nrules;
    uint64_t fail_task; /* 0 = none */
} g_cfg;

/* ------------------------------------------------------------------ state */
struct stream;
struct event;

typedef struct block {
    struct block *next; /* sorted by offset (device) / unsorted (host) */
    int device;         /* -1 for host (aclrtMallocHost) */
    char *base;         /* handed-out address */
    size_t offset;      /* within the device range */
    size_t usable;      /* bytes usable (padding included) */
    size_t reserved;    /* bytes taken from the range (64-multiple) / mmap length */
    size_t requested;
    int pending; /* queued tasks referencing the block */
    int freed;   /* aclrtFree'd while pending > 0: poisoned */
} block;

typedef struct device {
    int fd;
    char *dev_base; /* PROT_NONE: the device addresses */
    char *rw_base;  /* RW view of the same memfd, used by stream workers only */
    size_t map_len;
    size_t used;
    block *blocks;
    int setcount;
    struct stream *default_stream;
    int nstreams;
    int nevents;
} device;

enum { T_COPY, T_MEMSET, T_RECORD, T_WAIT, T_RESET_EVENT, T_CALLBACK, T_HOSTFUNC, T_KERNEL };

typedef struct task {
    struct task *next;
    int kind;
    char *dst;
    const char *src;
    size_t n;
    int value;
    block *refs[2];
    struct event *ev;
    uint64_t gen;
    aclrtCallback cb;
    void *data;
    int cb_block;
    char name[96];
    int (*run)(void *);
    void (*release)(void *);
} task;

typedef struct stream {
    struct stream *next_all;
    int device;
    int is_default;
    pthread_t worker;
    int worker_started;
    pthread_cond_t cv;
    task *head, *tail;
    uint64_t enq, done;
    int err;
    char errmsg[1024];
    int failure_mode;
    int stopped;
    int quit;
    int discard;
    int subscribed;
    uint64_t sub_tid;
    int used_callback;
    int used_hostfunc;
} stream;

typedef struct event {
    struct event *next_all, *prev_all;
    int device;
    uint32_t flags;
    int with_flag; /* created by a WithFlag API: SYNC must be asked for */
    uint64_t record_gen, complete_gen;
    int recorded;   /* has been recorded (and not reset) */
    int has_time;
    double time_ms;
    int refs; /* pending tasks */
    int destroyed;
} event;

typedef struct cb_item {
    struct cb_item *next;
    aclrtCallback fn;
    void *data;
    int block;
    int done;
} cb_item;

typedef struct reporter {
    struct reporter *next;
    uint64_t tid;
    int device;
    int nstreams;
    cb_item *head, *tail;
} reporter;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cond; /* CLOCK_MONOTONIC; any completion / state change */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_init_count;
static uint64_t g_gen = 1; /* bumped by aclFinalize; thread-local state of older generations is void */
static int g_shutdown;
static device g_dev[MAX_DEVICES];
static stream *g_streams;
static event *g_events;

/* A set of live handles (open addressing, linear probing, tombstones): checking an event handle
 * costs O(1) however many events exist (a program may keep thousands). */
typedef struct {
    uintptr_t *slots; /* 0 empty, 1 tombstone, else a handle */
    size_t cap, used, live;
} ptrset;
static ptrset g_live_events;

static size_t ps_slot(uintptr_t p, size_t cap) {
    p ^= p >> 33;
    p *= 0xff51afd7ed558ccdULL;
    p ^= p >> 33;
    return (size_t)p & (cap - 1);
}

static int ps_contains(const ptrset *set, const void *p) {
    if (!set->cap) return 0;
    for (size_t i = ps_slot((uintptr_t)p, set->cap);; i = (i + 1) & (set->cap - 1)) {
        if (set->slots[i] == (uintptr_t)p) return 1;
        if (set->slots[i] == 0) return 0;
    }
}

static int ps_insert(ptrset *set, const void *p) {
    if ((set->used + 1) * 2 > set->cap) { /* rehash: drop tombstones, keep the load under 1/2 */
        size_t cap = 64;
        while (cap < (set->live + 1) * 4) cap *= 2;
        uintptr_t *slots = calloc(cap, sizeof *slots);
        if (!slots) return -1;
        for (size_t k = 0; k < set->cap; k++) {
            uintptr_t v = set->slots[k];
            if (v > 1) {
                size_t i = ps_slot(v, cap);
                while (slots[i]) i = (i + 1) & (cap - 1);
                slots[i] = v;
            }
        }
        free(set->slots);
        set->slots = slots;
        set->cap = cap;
        set->used = set->live;
    }
    size_t i = ps_slot((uintptr_t)p, set->cap);
    while (set->slots[i] > 1) i = (i + 1) & (set->cap - 1);
    if (set->slots[i] == 0) set->used++;
    set->slots[i] = (uintptr_t)p;
    set->live++;
    return 0;
}

static void ps_remove(ptrset *set, const void *p) {
    if (!set->cap) return;
    for (size_t i = ps_slot((uintptr_t)p, set->cap);; i = (i + 1) & (set->cap - 1)) {
        if (set->slots[i] == 0) return;
        if (set->slots[i] == (uintptr_t)p) {
            set->slots[i] = 1;
            set->live--;
            return;
        }
    }
}
static reporter *g_reporters;
static block *g_host_blocks;
static uint64_t g_tasks_executed;
static int g_nsubs;

static __thread int t_device = -1;
static __thread uint64_t t_device_gen;
static __thread char t_msg[MSG_CAP];
static __thread size_t t_msg_len;
static __thread char t_ret[MSG_CAP];
static __thread int t_last_error;
static __thread int t_in_callback;
static __thread stream *t_worker;

static void init_once(void) {
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&g_cond, &a);
    pthread_condattr_destroy(&a);
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void deadline_after(struct timespec *ts, long ms) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static void sleep_ns(double ns) {
    if (ns <= 0) return;
    struct timespec ts = {(time_t)(ns / 1e9), (long)((uint64_t)ns % 1000000000ULL)};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
    }
}

static double mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* The timing model is the modelled device's speed: a copy of `bytes` takes at least
 * bytes / ACLDOUBLE_COPY_GBPS, however long the host's own memmove took (started at `began`). */
static void model_copy(double began, size_t bytes) {
    if (g_cfg.copy_gbps > 0) sleep_ns((double)bytes / g_cfg.copy_gbps - (mono_ns() - began));
}


/* ------------------------------------------------------------------ errors */
static void append_msg(const char *func, const char *text) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    localtime_r(&ts.tv_sec, &tm);
    char when[64];
    snprintf(when, sizeof when, "%04d-%02d-%02d-%02d:%02d:%02d.%03ld.%03ld", tm.tm_year + 1900, tm.tm_mon + 1,
             tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000, (ts.tv_nsec / 1000) % 1000);
    if (t_msg_len > 0 && t_msg_len + 1 < MSG_CAP) t_msg[t_msg_len++] = '\n';
    if (t_msg_len >= MSG_CAP - 1) return;
    int n = snprintf(t_msg + t_msg_len, MSG_CAP - t_msg_len, "EE9999: [PID: %d] %s %s: Reason: %s", (int)getpid(),
                     when, func, text);
    if (n > 0) t_msg_len += (size_t)n < MSG_CAP - t_msg_len ? (size_t)n : MSG_CAP - 1 - t_msg_len;
}

__attribute__((format(printf, 3, 4))) static aclError fail(const char *func, aclError code, const char *fmt, ...) {
    char text[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    append_msg(func, text);
    t_last_error = code;
    return code;
}

/* For sibling doubles (aclnn): a failure message into this thread's aclGetRecentErrMsg buffer, as
 * CANN's op libraries report through the same buffer. */
EXPORT __attribute__((format(printf, 3, 4))) void acldouble_set_error(int code, const char *func, const char *fmt,
                                                                       ...) {
    char text[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    append_msg(func, text);
    t_last_error = code;
}

EXPORT const char *aclGetRecentErrMsg(void) {
    if (t_msg_len == 0) return NULL;
    memcpy(t_ret, t_msg, t_msg_len + 1);
    t_msg_len = 0;
    t_msg[0] = 0;
    return t_ret;
}

EXPORT aclError aclrtPeekAtLastError(aclrtLastErrLevel level) {
    (void)level;
    return t_last_error;
}

EXPORT aclError aclrtGetLastError(aclrtLastErrLevel level) {
    (void)level;
    int e = t_last_error;
    t_last_error = 0;
    return e;
}

/* ------------------------------------------------------------------ helpers (g_lock held) */
static int natural_code(const char *func) {
    if (strncmp(func, "aclrtMalloc", 11) == 0) return ACL_ERROR_RT_MEMORY_ALLOCATION;
    if (strncmp(func, "aclrtMemcpy", 11) == 0 || strncmp(func, "aclrtMemset", 11) == 0) return ACL_ERROR_RT_PARAM_INVALID;
    if (strncmp(func, "aclrtCreateStream", 17) == 0) return ACL_ERROR_RT_NO_STREAM_RESOURCE;
    if (strncmp(func, "aclrtCreateEvent", 16) == 0) return ACL_ERROR_RT_NO_EVENT_RESOURCE;
    if (strcmp(func, "aclrtSetDevice") == 0) return ACL_ERROR_RT_INVALID_DEVICEID;
    if (strncmp(func, "aclrtSynchronize", 16) == 0) return ACL_ERROR_RT_AICORE_EXCEPTION;
    if (strcmp(func, "aclrtFree") == 0 || strcmp(func, "aclrtFreeHost") == 0) return ACL_ERROR_RT_PARAM_INVALID;
    return ACL_ERROR_RT_INTERNAL_ERROR;
}

/* ACLDOUBLE_FAIL func:N — returns the injected code for this call, or 0. Counts every call. */
static int injected(const char *func) {
    int code = 0;
    for (int i = 0; i < g_cfg.nrules; i++) {
        fail_rule *r = &g_cfg.rules[i];
        if (strcmp(r->func, func) != 0) continue;
        r->calls++;
        if (r->calls == r->n) code = r->code ? r->code : natural_code(func);
    }
    return code;
}

#define INJECT(func)                                                                                          \
    do {                                                                                                      \
        int _c = injected(func);                                                                              \
        if (_c) {                                                                                             \
            pthread_mutex_unlock(&g_lock);                                                                    \
            return fail(func, _c, "injected failure (ACLDOUBLE_FAIL)");                                       \
        }                                                                                                     \
    } while (0)

static int cur_device(void) { return (t_device_gen == g_gen) ? t_device : -1; }

/* init + current device checks. Returns 0 or an error (already reported). Lock held on entry and kept. */
static aclError need_init(const char *func) {
    if (g_init_count == 0)
        return fail(func, ACL_ERROR_UNINITIALIZE, "double-only: %s called before aclInit (or after aclFinalize)",
                    func);
    return 0;
}

static aclError need_ctx(const char *func) {
    aclError e = need_init(func);
    if (e) return e;
    if (cur_device() < 0)
        return fail(func, ACL_ERROR_RT_CONTEXT_NULL,
                    "context pointer null: this thread has no current device (call aclrtSetDevice first)");
    return 0;
}

static aclError not_in_callback(const char *func) {
    if (t_in_callback)
        return fail(func, ACL_ERROR_RT_PARAM_INVALID,
                    "double-only: %s called from inside a callback / host function (forbidden: deadlock risk)", func);
    return 0;
}

static device *dev_of_ptr(const void *p, int *id) {
    for (int i = 0; i < g_cfg.device_count; i++) {
        device *d = &g_dev[i];
        if (d->dev_base && (const char *)p >= d->dev_base && (const char *)p < d->dev_base + g_cfg.memory_bytes) {
            if (id) *id = i;
            return d;
        }
    }
    return NULL;
}

/* live (not freed) device block containing [p, p+n) */
static block *find_dev_block(const void *p, size_t n, int include_freed) {
    int id;
    device *d = dev_of_ptr(p, &id);
    if (!d) return NULL;
    for (block *b = d->blocks; b; b = b->next) {
        if ((const char *)p >= b->base && (const char *)p < b->base + b->usable) {
            if (b->freed && !include_freed) return NULL;
            if ((size_t)((const char *)p - b->base) + n > b->usable) return NULL;
            return b;
        }
    }
    return NULL;
}

static block *find_host_block(const void *p) {
    for (block *b = g_host_blocks; b; b = b->next)
        if (!b->freed && (const char *)p >= b->base && (const char *)p < b->base + b->usable) return b;
    return NULL;
}

static char *rw_addr(const void *devptr) {
    int id;
    device *d = dev_of_ptr(devptr, &id);
    return d->rw_base + ((const char *)devptr - d->dev_base);
}

static void release_block_storage(block *b) {
    if (b->device < 0) {
        munmap(b->base, b->reserved);
        block **pp = &g_host_blocks;
        while (*pp && *pp != b) pp = &(*pp)->next;
        if (*pp) *pp = b->next;
    } else {
        device *d = &g_dev[b->device];
        if (b->reserved >= (1u << 20))
            (void)fallocate(d->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)b->offset, (off_t)b->reserved);
        d->used -= b->reserved;
        block **pp = &d->blocks;
        while (*pp && *pp != b) pp = &(*pp)->next;
        if (*pp) *pp = b->next;
    }
    free(b);
}

static void unref_block(block *b) {
    if (!b) return;
    b->pending--;
    if (b->freed && b->pending == 0) release_block_storage(b);
}

static void unref_event(event *e) {
    if (!e) return;
    e->refs--;
    if (e->destroyed && e->refs == 0) {
        if (e->prev_all) e->prev_all->next_all = e->next_all;
        else g_events = e->next_all;
        if (e->next_all) e->next_all->prev_all = e->prev_all;
        free(e);
    }
}

/* ------------------------------------------------------------------ streams */
static void *worker_main(void *arg);

static stream *stream_new(int dev, int is_default) {
    stream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->device = dev;
    s->is_default = is_default;
    pthread_cond_init(&s->cv, NULL);
    if (pthread_create(&s->worker, NULL, worker_main, s) != 0) {
        pthread_cond_destroy(&s->cv);
        free(s);
        return NULL;
    }
    s->worker_started = 1;
    s->next_all = g_streams;
    g_streams = s;
    g_dev[dev].nstreams++;
    return s;
}

static int stream_known(stream *s) {
    for (stream *x = g_streams; x; x = x->next_all)
        if (x == s) return 1;
    return 0;
}

/* NULL = current device's default stream (created lazily). Needs a current device. */
static aclError resolve_stream(const char *func, aclrtStream h, stream **out) {
    int dev = cur_device();
    if (h == NULL) {
        device *d = &g_dev[dev];
        if (!d->default_stream) {
            d->default_stream = stream_new(dev, 1);
            if (!d->default_stream) return fail(func, ACL_ERROR_RT_NO_STREAM_RESOURCE, "cannot start default stream");
        }
        *out = d->default_stream;
        return 0;
    }
    stream *s = (stream *)h;
    if (!stream_known(s))
        return fail(func, ACL_ERROR_RT_PARAM_INVALID, "double-only: unknown or destroyed stream handle %p", h);
    if (s->device != dev)
        return fail(func, ACL_ERROR_RT_STREAM_CONTEXT,
                    "stream %p belongs to device %d but this thread's current device is %d", h, s->device, dev);
    *out = s;
    return 0;
}

static aclError stream_accepts(const char *func, stream *s) {
    if (s->stopped)
        return fail(func, ACL_ERROR_RT_AICORE_EXCEPTION,
                    "stream %p is in ACL_STOP_ON_FAILURE mode and a task failed: %s (synchronize it to clear)",
                    (void *)s, s->errmsg);
    return 0;
}

static void enqueue(stream *s, task *t) {
    t->next = NULL;
    if (s->tail)
        s->tail->next = t;
    else
        s->head = t;
    s->tail = t;
    __atomic_add_fetch(&s->enq, 1, __ATOMIC_RELEASE); /* read unlocked by a polling worker */
    pthread_cond_signal(&s->cv);
}

static void task_failed(stream *s, int code, const char *msg) {
    if (!s->err) {
        s->err = code;
        snprintf(s->errmsg, sizeof s->errmsg, "%s", msg);
    }
    if (s->failure_mode == ACL_STOP_ON_FAILURE) s->stopped = 1;
}

/* Run one task; g_lock NOT held. Returns 0 or an error code with msg filled. */
static int exec_task(stream *s, task *t, char *msg, size_t cap) {
    int rc = 0;
    switch (t->kind) {
    case T_COPY:
    case T_MEMSET: {
        pthread_mutex_lock(&g_lock);
        for (int i = 0; i < 2; i++) {
            if (t->refs[i] && t->refs[i]->freed) {
                snprintf(msg, cap,
                         "double-only: use-after-free: device memory %p was freed with aclrtFree while this "
                         "queued %s still used it",
                         (void *)t->refs[i]->base, t->kind == T_COPY ? "aclrtMemcpyAsync" : "aclrtMemsetAsync");
                pthread_mutex_unlock(&g_lock);
                return ACL_ERROR_RT_AICORE_EXCEPTION;
            }
        }
        char *dst = (t->refs[0] && t->refs[0]->device >= 0) ? rw_addr(t->dst) : t->dst;
        const char *src = (t->kind == T_COPY && t->refs[1] && t->refs[1]->device >= 0) ? rw_addr(t->src) : t->src;
        pthread_mutex_unlock(&g_lock);
        if (t->kind == T_COPY) {
            double began = mono_ns();
            memmove(dst, src, t->n);
            model_copy(began, t->n);
        } else {
            memset(dst, t->value, t->n);
        }
        break;
    }
    case T_RECORD:
        pthread_mutex_lock(&g_lock);
        if (t->gen > t->ev->complete_gen) {
            t->ev->complete_gen = t->gen;
            t->ev->time_ms = now_ms();
            t->ev->has_time = 1;
        }
        pthread_cond_broadcast(&g_cond);
        pthread_mutex_unlock(&g_lock);
        break;
    case T_RESET_EVENT:
        pthread_mutex_lock(&g_lock);
        t->ev->has_time = 0;
        pthread_cond_broadcast(&g_cond);
        pthread_mutex_unlock(&g_lock);
        break;
    case T_WAIT:
        pthread_mutex_lock(&g_lock);
        while (t->ev->complete_gen < t->gen && !g_shutdown && !s->discard) pthread_cond_wait(&g_cond, &g_lock);
        pthread_mutex_unlock(&g_lock);
        break;
    case T_CALLBACK: {
        pthread_mutex_lock(&g_lock);
        reporter *r = NULL;
        if (s->subscribed)
            for (r = g_reporters; r && r->tid != s->sub_tid; r = r->next) {
            }
        if (!r) {
            snprintf(msg, cap, "callback reached the stream after its report thread unsubscribed");
            pthread_mutex_unlock(&g_lock);
            return ACL_ERROR_RT_STREAM_NO_CB_REG;
        }
        cb_item *it = calloc(1, sizeof *it);
        it->fn = t->cb;
        it->data = t->data;
        it->block = t->cb_block;
        if (r->tail)
            r->tail->next = it;
        else
            r->head = it;
        r->tail = it;
        pthread_cond_broadcast(&g_cond);
        if (it->block) {
            while (!it->done && !g_shutdown && !s->discard) pthread_cond_wait(&g_cond, &g_lock);
            if (it->done) free(it); /* else: owned by the reporter queue, freed at finalize */
        }
        pthread_mutex_unlock(&g_lock);
        break;
    }
    case T_HOSTFUNC:
        t_in_callback = 1;
        t->cb(t->data);
        t_in_callback = 0;
        break;
    case T_KERNEL:
        if (t->run && t->run(t->data) != 0) {
            snprintf(msg, cap, "kernel task '%s' failed (AI Core exception)", t->name);
            rc = ACL_ERROR_RT_AICORE_EXCEPTION;
        }
        break;
    }
    return rc;
}

static int counts_as_work(int kind) { return kind == T_COPY || kind == T_MEMSET || kind == T_KERNEL; }

/* How long an idle worker polls its queue before it sleeps. A device polls its queue: a host
 * launching back to back should not pay a thread wake-up (a futex call and a context switch, a
 * few microseconds) per launch, which no NPU costs. */
#define WORKER_POLL_NS 50000

/* Polls (g_lock not held) until work was enqueued beyond `seen`, the stream quits, or the poll
 * time is over. */
static void poll_queue(stream *s, uint64_t seen) {
    struct timespec began, at;
    clock_gettime(CLOCK_MONOTONIC, &began);
    for (unsigned i = 1;; i++) {
        if (__atomic_load_n(&s->enq, __ATOMIC_ACQUIRE) != seen || __atomic_load_n(&s->quit, __ATOMIC_ACQUIRE)) return;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ volatile("yield");
#endif
        if (i % 64 == 0) {
            clock_gettime(CLOCK_MONOTONIC, &at);
            if ((at.tv_sec - began.tv_sec) * 1000000000L + (at.tv_nsec - began.tv_nsec) > WORKER_POLL_NS) return;
        }
    }
}

static void *worker_main(void *arg) {
    stream *s = arg;
    t_worker = s;
    pthread_mutex_lock(&g_lock);
    for (;;) {
        if (!s->head && !s->quit) {
            uint64_t seen = s->enq;
            pthread_mutex_unlock(&g_lock);
            poll_queue(s, seen);
            pthread_mutex_lock(&g_lock);
        }
        while (!s->head && !s->quit) pthread_cond_wait(&s->cv, &g_lock);
        if (!s->head) break;
        task *t = s->head;
        int skip = s->stopped || g_shutdown || s->discard;
        int inject = 0;
        if (!skip && counts_as_work(t->kind)) {
            g_tasks_executed++;
            if (g_cfg.fail_task && g_tasks_executed == g_cfg.fail_task) inject = 1;
        }
        pthread_mutex_unlock(&g_lock);
        char msg[1024] = "";
        int rc = 0;
        if (!skip) {
            if (g_cfg.launch_us > 0) sleep_ns(g_cfg.launch_us * 1e3);
            if (inject) {
                snprintf(msg, sizeof msg, "injected task failure (ACLDOUBLE_FAIL task:%" PRIu64 ") in task '%s'",
                         g_cfg.fail_task, t->kind == T_KERNEL ? t->name : (t->kind == T_COPY ? "memcpy" : "memset"));
                rc = ACL_ERROR_RT_AICORE_EXCEPTION;
            } else {
                rc = exec_task(s, t, msg, sizeof msg);
            }
        }
        if (t->kind == T_KERNEL && t->release) t->release(t->data);
        pthread_mutex_lock(&g_lock);
        if (rc) task_failed(s, rc, msg);
        unref_block(t->refs[0]);
        unref_block(t->refs[1]);
        unref_event(t->ev);
        s->head = t->next;
        if (!s->head) s->tail = NULL;
        s->done++;
        free(t);
        pthread_cond_broadcast(&g_cond);
    }
    pthread_mutex_unlock(&g_lock);
    return NULL;
}

/* wait for all tasks enqueued so far; timeout_ms -1 = forever. Returns 0, or 1 on timeout. Lock held. */
static int stream_wait(stream *s, long timeout_ms) {
    uint64_t target = s->enq;
    struct timespec dl;
    if (timeout_ms >= 0) deadline_after(&dl, timeout_ms);
    while (s->done < target) {
        if (timeout_ms < 0)
            pthread_cond_wait(&g_cond, &g_lock);
        else if (pthread_cond_timedwait(&g_cond, &g_lock, &dl) == ETIMEDOUT && s->done < target)
            return 1;
    }
    return 0;
}

/* wait until every stream of `dev` has run what was enqueued (lock held; rescans after each wake,
 * so streams destroyed meanwhile are never touched) */
static void wait_device_idle(int dev) {
    for (;;) {
        stream *busy = NULL;
        for (stream *s = g_streams; s; s = s->next_all)
            if (s->device == dev && s->done < s->enq) {
                busy = s;
                break;
            }
        if (!busy) return;
        pthread_cond_wait(&g_cond, &g_lock);
    }
}

static aclError take_stream_error(const char *func, stream *s) {
    if (!s->err) return 0;
    int e = s->err;
    char m[1100];
    snprintf(m, sizeof m, "%s", s->errmsg);
    s->err = 0;
    s->errmsg[0] = 0;
    s->stopped = 0;
    return fail(func, e, "asynchronous task failure on stream %p: %s", (void *)s, m);
}

/* stop the worker and free the stream (lock held; the lock is dropped while joining) */
static void stream_free(stream *s) {
    __atomic_store_n(&s->quit, 1, __ATOMIC_RELEASE);
    pthread_cond_signal(&s->cv);
    stream **pp = &g_streams;
    while (*pp && *pp != s) pp = &(*pp)->next_all;
    if (*pp) *pp = s->next_all;
    g_dev[s->device].nstreams--;
    if (s->subscribed) {
        for (reporter *r = g_reporters; r; r = r->next)
            if (r->tid == s->sub_tid) r->nstreams--;
        g_nsubs--;
        s->subscribed = 0;
    }
    pthread_mutex_unlock(&g_lock);
    if (s->worker_started) pthread_join(s->worker, NULL);
    pthread_mutex_lock(&g_lock);
    pthread_cond_destroy(&s->cv);
    free(s);
}

/* ------------------------------------------------------------------ init / finalize */
static size_t env_size(const char *name, size_t dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    return (size_t)strtoull(v, NULL, 0);
}

static void read_config(void) {
    memset(&g_cfg, 0, sizeof g_cfg);
    g_cfg.device_count = (int)env_size("ACLDOUBLE_DEVICE_COUNT", 1);
    if (g_cfg.device_count < 0) g_cfg.device_count = 0;
    if (g_cfg.device_count > MAX_DEVICES) g_cfg.device_count = MAX_DEVICES;
    g_cfg.memory_bytes = env_size("ACLDOUBLE_MEMORY_BYTES", (size_t)1 << 30);
    const char *soc = getenv("ACLDOUBLE_SOC");
    snprintf(g_cfg.soc, sizeof g_cfg.soc, "%s", soc && *soc ? soc : "Ascend910B1");
    const char *gb = getenv("ACLDOUBLE_COPY_GBPS");
    g_cfg.copy_gbps = gb ? strtod(gb, NULL) : 0;
    g_cfg.launch_us = (long)env_size("ACLDOUBLE_LAUNCH_US", 0);
    const char *mode = getenv("ACLDOUBLE_MODE");
    g_cfg.compat = mode && strcmp(mode, "compat") == 0;
    const char *rf = getenv("ACLDOUBLE_REPORT_FILE");
    snprintf(g_cfg.report_file, sizeof g_cfg.report_file, "%s", rf ? rf : "");
    const char *f = getenv("ACLDOUBLE_FAIL");
    if (f && *f) {
        char buf[2048];
        snprintf(buf, sizeof buf, "%s", f);
        char *save = NULL;
        for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
            while (*tok == ' ') tok++;
            char *c1 = strchr(tok, ':');
            if (!c1) continue;
            *c1 = 0;
            char *c2 = strchr(c1 + 1, ':');
            if (c2) *c2 = 0;
            uint64_t n = strtoull(c1 + 1, NULL, 10);
            if (n == 0) continue;
            if (strcmp(tok, "task") == 0) {
                g_cfg.fail_task = n;
            } else if (g_cfg.nrules < 64) {
                fail_rule *r = &g_cfg.rules[g_cfg.nrules++];
                snprintf(r->func, sizeof r->func, "%s", tok);
                r->n = n;
                r->code = c2 ? atoi(c2 + 1) : 0;
            }
        }
    }
}

EXPORT aclError aclInit(const char *configPath) {
    pthread_once(&g_once, init_once);
    pthread_mutex_lock(&g_lock);
    if (g_init_count > 0) {
        g_init_count++;
        pthread_mutex_unlock(&g_lock);
        return fail("aclInit", ACL_ERROR_REPEAT_INITIALIZE, "repeated initialization (reference count now %d)",
                    g_init_count);
    }
    if (configPath && *configPath) {
        FILE *fp = fopen(configPath, "r");
        if (!fp) {
            pthread_mutex_unlock(&g_lock);
            return fail("aclInit", ACL_ERROR_INVALID_FILE, "cannot read config file %s", configPath);
        }
        fclose(fp);
    }
    read_config();
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (int i = 0; i < g_cfg.device_count; i++) {
        device *d = &g_dev[i];
        memset(d, 0, sizeof *d);
        d->map_len = ALIGN_UP(g_cfg.memory_bytes ? g_cfg.memory_bytes : page, page);
        char name[32];
        snprintf(name, sizeof name, "acldouble-dev%d", i);
        d->fd = memfd_create(name, MFD_CLOEXEC);
        if (d->fd < 0 || ftruncate(d->fd, (off_t)d->map_len) != 0) goto oom;
        d->dev_base = mmap(NULL, d->map_len, PROT_NONE, MAP_SHARED, d->fd, 0);
        d->rw_base = mmap(NULL, d->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, d->fd, 0);
        if (d->dev_base == MAP_FAILED || d->rw_base == MAP_FAILED) goto oom;
    }
    g_init_count = 1;
    g_shutdown = 0;
    pthread_mutex_unlock(&g_lock);
    return 0;
oom:
    pthread_mutex_unlock(&g_lock);
    return fail("aclInit", ACL_ERROR_RT_INTERNAL_ERROR, "cannot map simulated device memory: %s", strerror(errno));
}

static void count_outstanding(uint64_t *da, uint64_t *ha, uint64_t *st, uint64_t *ev, uint64_t *subs) {
    uint64_t a = 0, h = 0, s = 0, e = 0;
    for (int i = 0; i < g_cfg.device_count; i++)
        for (block *b = g_dev[i].blocks; b; b = b->next)
            if (!b->freed) a++;
    for (block *b = g_host_blocks; b; b = b->next)
        if (!b->freed) h++;
    for (stream *x = g_streams; x; x = x->next_all)
        if (!x->is_default) s++;
    for (event *x = g_events; x; x = x->next_all)
        if (!x->destroyed) e++;
    if (da) *da = a;
    if (ha) *ha = h;
    if (st) *st = s;
    if (ev) *ev = e;
    if (subs) *subs = (uint64_t)g_nsubs;
}

EXPORT int acldoubleOutstanding(uint64_t *device_allocs, uint64_t *host_allocs, uint64_t *streams, uint64_t *events) {
    pthread_mutex_lock(&g_lock);
    if (g_init_count == 0) {
        pthread_mutex_unlock(&g_lock);
        return fail("acldoubleOutstanding", ACL_ERROR_UNINITIALIZE, "double-only: not initialized");
    }
    count_outstanding(device_allocs, host_allocs, streams, events, NULL);
    pthread_mutex_unlock(&g_lock);
    return 0;
}

static void do_finalize(void) {
    uint64_t a, h, s, e, sub;
    size_t bytes = 0;
    count_outstanding(&a, &h, &s, &e, &sub);
    for (int i = 0; i < g_cfg.device_count; i++)
        for (block *b = g_dev[i].blocks; b; b = b->next)
            if (!b->freed) bytes += b->requested;
    if (a || h || s || e || sub)
        fprintf(stderr,
                "acldouble: outstanding at aclFinalize: %" PRIu64 " device allocation(s) (%zu bytes), %" PRIu64
                " host allocation(s), %" PRIu64 " stream(s), %" PRIu64 " event(s), %" PRIu64 " subscription(s)\n",
                a, bytes, h, s, e, sub);
    if (g_cfg.report_file[0]) {
        FILE *fp = fopen(g_cfg.report_file, "a");
        if (fp) {
            fprintf(fp,
                    "{\"pid\": %d, \"device_allocs\": %" PRIu64 ", \"device_bytes\": %zu, \"host_allocs\": %" PRIu64
                    ", \"streams\": %" PRIu64 ", \"events\": %" PRIu64 ", \"subscriptions\": %" PRIu64 "}\n",
                    (int)getpid(), a, bytes, h, s, e, sub);
            fclose(fp);
        }
    }
    /* tear down: discard queued work, stop workers */
    g_shutdown = 1;
    pthread_cond_broadcast(&g_cond);
    while (g_streams) stream_free(g_streams);
    for (int i = 0; i < g_cfg.device_count; i++) {
        device *d = &g_dev[i];
        while (d->blocks) {
            block *b = d->blocks;
            d->blocks = b->next;
            free(b);
        }
        if (d->dev_base && d->dev_base != MAP_FAILED) munmap(d->dev_base, d->map_len);
        if (d->rw_base && d->rw_base != MAP_FAILED) munmap(d->rw_base, d->map_len);
        if (d->fd > 0) close(d->fd);
        memset(d, 0, sizeof *d);
    }
    while (g_host_blocks) {
        block *b = g_host_blocks;
        g_host_blocks = b->next;
        munmap(b->base, b->reserved);
        free(b);
    }
    while (g_events) {
        event *x = g_events;
        g_events = x->next_all;
        free(x);
    }
    free(g_live_events.slots);
    memset(&g_live_events, 0, sizeof g_live_events);
    while (g_reporters) {
        reporter *r = g_reporters;
        g_reporters = r->next;
        while (r->head) {
            cb_item *it = r->head;
            r->head = it->next;
            free(it);
        }
        free(r);
    }
    g_nsubs = 0;
    g_tasks_executed = 0;
    g_init_count = 0;
    g_gen++;
    g_shutdown = 0;
    pthread_cond_broadcast(&g_cond);
}

EXPORT aclError aclFinalize(void) {
    pthread_mutex_lock(&g_lock);
    if (g_init_count == 0) {
        pthread_mutex_unlock(&g_lock);
        return fail("aclFinalize", ACL_ERROR_REPEAT_FINALIZE, "repeated finalization (or aclFinalize before aclInit)");
    }
    if (t_in_callback || t_worker) {
        pthread_mutex_unlock(&g_lock);
        return fail("aclFinalize", ACL_ERROR_RT_PARAM_INVALID, "double-only: aclFinalize from inside a callback");
    }
    do_finalize();
    pthread_mutex_unlock(&g_lock);
    return 0;
}

EXPORT aclError aclFinalizeReference(uint64_t *refCount) {
    pthread_mutex_lock(&g_lock);
    if (g_init_count == 0) {
        pthread_mutex_unlock(&g_lock);
        return fail("aclFinalizeReference", ACL_ERROR_REPEAT_FINALIZE, "repeated finalization");
    }
    g_init_count--;
    if (refCount) *refCount = (uint64_t)g_init_count;
    if (g_init_count == 0) {
        g_init_count = 1;
        do_finalize();
    }
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* ------------------------------------------------------------------ versions, devices */
EXPORT aclError aclsysGetVersionStr(char *pkgName, char *versionStr) {
    if (!pkgName || !versionStr) return fail("aclsysGetVersionStr", ACL_ERROR_INVALID_PARAM, "null argument");
    snprintf(versionStr, 128, "8.5.0.double");
    return 0;
}

EXPORT aclError aclrtGetVersion(int32_t *major, int32_t *minor, int32_t *patch) {
    if (!major || !minor || !patch) return fail("aclrtGetVersion", ACL_ERROR_INVALID_PARAM, "null argument");
    *major = 1;
    *minor = 17;
    *patch = 0;
    return 0;
}

EXPORT const char *aclrtGetSocName(void) {
    pthread_mutex_lock(&g_lock);
    const char *r = g_init_count ? g_cfg.soc : NULL;
    pthread_mutex_unlock(&g_lock);
    if (!r) fail("aclrtGetSocName", ACL_ERROR_UNINITIALIZE, "double-only: aclrtGetSocName before aclInit");
    return r;
}

#define LOCKED_INIT(func)                                                                                     \
    pthread_mutex_lock(&g_lock);                                                                              \
    do {                                                                                                      \
        aclError _e = need_init(func);                                                                        \
        if (_e) {                                                                                             \
            pthread_mutex_unlock(&g_lock);                                                                    \
            return _e;                                                                                        \
        }                                                                                                     \
    } while (0)

#define LOCKED_CTX(func)                                                                                      \
    pthread_mutex_lock(&g_lock);                                                                              \
    do {                                                                                                      \
        aclError _e = need_ctx(func);                                                                         \
        if (_e) {                                                                                             \
            pthread_mutex_unlock(&g_lock);                                                                    \
            return _e;                                                                                        \
        }                                                                                                     \
    } while (0)

#define RET(x)                                                                                                \
    do {                                                                                                      \
        aclError _ret = (x);                                                                                  \
        pthread_mutex_unlock(&g_lock);                                                                        \
        return _ret;                                                                                          \
    } while (0)

#define CHECK(x)                                                                                              \
    do {                                                                                                      \
        aclError _chk = (x);                                                                                  \
        if (_chk) RET(_chk);                                                                                     \
    } while (0)

EXPORT aclError aclrtGetDeviceCount(uint32_t *count) {
    LOCKED_INIT("aclrtGetDeviceCount");
    if (!count) RET(fail("aclrtGetDeviceCount", ACL_ERROR_INVALID_PARAM, "count is null"));
    *count = (uint32_t)g_cfg.device_count;
    RET(0);
}

EXPORT aclError aclrtSetDevice(int32_t deviceId) {
    const char *F = "aclrtSetDevice";
    LOCKED_INIT(F);
    CHECK(not_in_callback(F));
    if (deviceId < 0 || deviceId >= g_cfg.device_count)
        RET(fail(F, ACL_ERROR_RT_INVALID_DEVICEID, "device id %d is out of range [0, %d)", deviceId,
                 g_cfg.device_count));
    INJECT(F);
    g_dev[deviceId].setcount++;
    t_device = deviceId;
    t_device_gen = g_gen;
    RET(0);
}

static aclError reset_device(const char *F, int32_t deviceId, int force) {
    LOCKED_INIT(F);
    CHECK(not_in_callback(F));
    if (deviceId < 0 || deviceId >= g_cfg.device_count)
        RET(fail(F, ACL_ERROR_RT_INVALID_DEVICEID, "device id %d is out of range [0, %d)", deviceId,
                 g_cfg.device_count));
    device *d = &g_dev[deviceId];
    if (d->setcount == 0)
        RET(fail(F, ACL_ERROR_RT_PARAM_INVALID,
                 "double-only: device %d reset more often than aclrtSetDevice was called", deviceId));
    d->setcount = force ? 0 : d->setcount - 1;
    if (d->setcount == 0) wait_device_idle(deviceId);
    if (cur_device() == deviceId && (force || d->setcount == 0)) t_device = -1;
    RET(0);
}

EXPORT aclError aclrtResetDevice(int32_t deviceId) { return reset_device("aclrtResetDevice", deviceId, 0); }
EXPORT aclError aclrtResetDeviceForce(int32_t deviceId) { return reset_device("aclrtResetDeviceForce", deviceId, 1); }

EXPORT aclError aclrtGetDevice(int32_t *deviceId) {
    LOCKED_CTX("aclrtGetDevice");
    if (!deviceId) RET(fail("aclrtGetDevice", ACL_ERROR_INVALID_PARAM, "deviceId is null"));
    *deviceId = cur_device();
    RET(0);
}

EXPORT aclError aclrtSynchronizeDevice(void) {
    const char *F = "aclrtSynchronizeDevice";
    LOCKED_CTX(F);
    CHECK(not_in_callback(F));
    INJECT(F);
    int dev = cur_device();
    aclError first = 0;
    wait_device_idle(dev);
    for (stream *s = g_streams; s; s = s->next_all)
        if (s->device == dev && s->err) {
            aclError e = take_stream_error(F, s);
            if (!first) first = e;
        }
    RET(first);
}

/* ------------------------------------------------------------------ stream API */
static aclError create_stream(const char *F, aclrtStream *out, uint32_t flag) {
    LOCKED_CTX(F);
    if (!out) RET(fail(F, ACL_ERROR_INVALID_PARAM, "stream out-pointer is null"));
    if (flag & ~ACL_STREAM_FLAG_MASK) RET(fail(F, ACL_ERROR_RT_PARAM_INVALID, "unknown stream flag bits 0x%x", flag));
    INJECT(F);
    int dev = cur_device();
    if (g_dev[dev].nstreams + (g_dev[dev].default_stream ? 0 : 1) >= MAX_STREAMS_PER_DEVICE)
        RET(fail(F, ACL_ERROR_RT_NO_STREAM_RESOURCE, "stream limit %d reached on device %d (default stream included)",
                 MAX_STREAMS_PER_DEVICE, dev));
    stream *s = stream_new(dev, 0);
    if (!s) RET(fail(F, ACL_ERROR_RT_NO_STREAM_RESOURCE, "cannot start stream worker"));
    *out = s;
    RET(0);
}

EXPORT aclError aclrtCreateStream(aclrtStream *stream) { return create_stream("aclrtCreateStream", stream, 0); }

EXPORT aclError aclrtCreateStreamWithConfig(aclrtStream *stream, uint32_t priority, uint32_t flag) {
    (void)priority;
    return create_stream("aclrtCreateStreamWithConfig", stream, flag);
}

static aclError destroy_stream(const char *F, aclrtStream h, int force) {
    LOCKED_CTX(F);
    CHECK(not_in_callback(F));
    if (!h) RET(fail(F, ACL_ERROR_RT_PARAM_INVALID, "the default stream cannot be destroyed"));
    stream *s;
    CHECK(resolve_stream(F, h, &s));
    if (force) {
        s->discard = 1;
        pthread_cond_broadcast(&g_cond);
    }
    stream_wait(s, -1);
    stream_free(s);
    RET(0);
}

EXPORT aclError aclrtDestroyStream(aclrtStream stream) { return destroy_stream("aclrtDestroyStream", stream, 0); }
EXPORT aclError aclrtDestroyStreamForce(aclrtStream stream) {
    return destroy_stream("aclrtDestroyStreamForce", stream, 1);
}

static aclError sync_stream(const char *F, aclrtStream h, int32_t timeout, int has_timeout) {
    LOCKED_CTX(F);
    CHECK(not_in_callback(F));
    if (has_timeout && (timeout == 0 || timeout < -1))
        RET(fail(F, ACL_ERROR_RT_PARAM_INVALID, "timeout %d is invalid (must be -1 or > 0 ms)", timeout));
    stream *s;
    CHECK(resolve_stream(F, h, &s));
    INJECT(F);
    if (stream_wait(s, has_timeout ? timeout : -1))
        RET(fail(F, ACL_ERROR_RT_STREAM_SYNC_TIMEOUT, "stream synchronize timed out after %d ms", timeout));
    RET(take_stream_error(F, s));
}

EXPORT aclError aclrtSynchronizeStream(aclrtStream stream) {
    return sync_stream("aclrtSynchronizeStream", stream, -1, 0);
}
EXPORT aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout) {
    return sync_stream("aclrtSynchronizeStreamWithTimeout", stream, timeout, 1);
}

EXPORT aclError aclrtStreamQuery(aclrtStream h, aclrtStreamStatus *status) {
    const char *F = "aclrtStreamQuery";
    LOCKED_CTX(F);
    if (!status) RET(fail(F, ACL_ERROR_INVALID_PARAM, "status is null"));
    stream *s;
    CHECK(resolve_stream(F, h, &s));
    *status = s->done == s->enq ? ACL_STREAM_STATUS_COMPLETE : ACL_STREAM_STATUS_NOT_READY;
    RET(0);
}

EXPORT aclError aclrtSetStreamFailureMode(aclrtStream h, uint64_t mode) {
    const char *F = "aclrtSetStreamFailureMode";
    LOCKED_CTX(F);
    if (mode > 1) RET(fail(F, ACL_ERROR_RT_PARAM_INVALID, "unknown failure mode %" PRIu64, mode));
    stream *s;
    CHECK(resolve_stream(F, h, &s));
    s->failure_mode = (int)mode;
    RET(0);
}

/* ------------------------------------------------------------------ events */
static int event_known(event *e) { return ps_contains(&g_live_events, e); }

static aclError resolve_event(const char *F, aclrtEvent h, event **out) {
    event *e = (event *)h;
    if (!h) return fail(F, ACL_ERROR_INVALID_PARAM, "event is null");
    if (!event_known(e))
        return fail(F, ACL_ERROR_RT_PARAM_INVALID, "double-only: unknown or destroyed event handle %p", h);
    if (e->device != cur_device())
        return fail(F, ACL_ERROR_RT_STREAM_CONTEXT,
                    "event %p belongs to device %d but this thread's current device is %d", h, e->device,
                    cur_device());
    *out = e;
    return 0;
}

static aclError create_event(const char *F, aclrtEvent *out, uint32_t flags, int with_flag) {
    LOCKED_CTX(F);
    if (!out) RET(fail(F, ACL_ERROR_INVALID_PARAM, "event out-pointer is null"));
    if (flags & ~ACL_EVENT_FLAG_MASK) RET(fail(F, ACL_ERROR_RT_PARAM_INVALID, "unknown event flag bits 0x%x", flags));
    INJECT(F);
    int dev = cur_device();
    if (g_dev[dev].nevents >= MAX_EVENTS_PER_DEVICE)
        RET(fail(F, ACL_ERROR_RT_NO_EVENT_RESOURCE, "event limit %d reached on device %d", MAX_EVENTS_PER_DEVICE, dev));
    event *e = calloc(1, sizeof *e);
    if (!e || ps_insert(&g_live_events, e)) {
        free(e);
        RET(fail(F, ACL_ERROR_RT_NO_EVENT_RESOURCE, "out of host memory"));
    }
    e->device = dev;
    e->flags = flags;
    e->with_flag = with_flag;
    e->next_all = g_events;
    if (g_events) g_events->prev_all = e;
    g_events = e;
    g_dev[dev].nevents++;
    *out = e;
    RET(0);
}

EXPORT aclError aclrtCreateEvent(aclrtEvent *event) {
    return create_event("aclrtCreateEvent", event, ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE, 0);
}
EXPORT aclError aclrtCreateEventWithFlag(aclrtEvent *event, uint32_t flag) {
    return create_event("aclrtCreateEventWithFlag", event, flag, 1);
}
EXPORT aclError aclrtCreateEventExWithFlag(aclrtEvent *event, uint32_t flag) {
    return create_event("aclrtCreateEventExWithFlag", event, flag, 1);
}

EXPORT aclError aclrtDestroyEvent(aclrtEvent h) {
    const char *F = "aclrtDestroyEvent";
    LOCKED_CTX(F);
    event *e;
    CHECK(resolve_event(F, h, &e));
    e->destroyed = 1;
    ps_remove(&g_live_events, e);
    g_dev[e->device].nevents--;
    e->refs++;
    unref_event(e); /* frees now unless tasks still reference it */
    RET(0);
}

static aclError event_task(const char *F, aclrtEvent eh, aclrtStream sh, int kind) {
    LOCKED_CTX(F);
    CHECK(not_in_callback(F));
    event *e;
    CHECK(resolve_event(F, eh, &e));
    stream *s;
    CHECK(resolve_stream(F, sh, &s));
    if (kind != T_RECORD && !(e->flags & ACL_EVENT_SYNC))
        RET(fail(F, ACL_ERROR_RT_PARAM_INVALID, "double-only: event %p was created without ACL_EVENT_SYNC", eh));
    CHECK(stream_accepts(F, s));
    INJECT(F);
    task *t = calloc(1, sizeof *t);
    t->kind = kind;
    t->ev = e;
    e->refs++;
    if (kind == T_RECORD) {
        t->gen = ++e->record_gen;
        e->recorded = 1;
    } else {
        e->recorded = 0;
        e->complete_gen = e->record_gen; /* reset: queries as complete, no timestamp */
    }
    enqueue(s, t);
    RET(0);
}

EXPORT aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream) {
    return event_task("aclrtRecordEvent", event, stream, T_RECORD);
}
EXPORT aclError aclrtResetEvent(aclrtEvent event, aclrtStream stream) {
    return event_task("aclrtResetEvent", event, stream, T_RESET_EVENT);
}

EXPORT aclError aclrtStreamWaitEvent(aclrtStream sh, aclrtEvent eh) {
    const char *F = "aclrtStreamWaitEvent";
    LOCKED_CTX(F);
    CHECK(not_in_callback(F));
    stream *s;
    CHECK(resolve_stream(F, sh, &s));
    event *e = (event *)eh;
    if (!eh) RET(fail(F, ACL_ERROR_INVALID_PARAM, "event is null"));
    if (!event_known(e)) RET(fail(F, ACL_ERROR_RT_PARAM_INVALID, "double-only: unknown or destroyed event %p", eh));
    if (!(e->flags & ACL_EVENT_SYNC))
        RET(fail(F, ACL_ERROR_RT_PARAM_INVALID,
                 "double-only: event %p was created without ACL_EVENT_SYNC and cannot be waited on", eh));
    CHECK(stream_accepts(F, s));
    INJECT(F);
    if (e->complete_gen >= e->record_gen) RET(0); /* nothing pending: no-op */
    task *t = calloc(1, sizeof *t);
    t->kind = T_WAIT;
    t->ev = e;
    t->gen = e->record_gen;
    e->refs++;
    enqueue(s, t);
    RET(0);
}

static int event_complete(event *e) { return e->complete_gen >= e->record_gen; }

EXPORT aclError aclrtQueryEventStatus(aclrtEvent h, aclrtEventRecordedStatus *status) {
    const char *F = "aclrtQueryEventStatus";
    LOCKED_CTX(F);
    if (!status) RET(fail(F, ACL_ERROR_INVALID_PARAM, "status is null"));
    event *e;
    CHECK(resolve_event(F, h, &e));
    *status = event_complete(e) ? ACL_EVENT_RECORDED_STATUS_COMPLETE : ACL_EVENT_RECORDED_STATUS_NOT_READY;
    RET(0);
}

EXPORT aclError aclrtQueryEvent(aclrtEvent h, aclrtEventStatus *status) {
    const char *F = "aclrtQueryEvent";
    LOCKED_CTX(F);
    if (!status) RET(fail(F, ACL_ERROR_INVALID_PARAM, "status is null"));
    event *e;
    CHECK(resolve_event(F, h, &e));
    *status = event_complete(e) ? ACL_EVENT_STATUS_COMPLETE : ACL_EVENT_STATUS_NOT_READY;
    RET(0);
}

static aclError sync_event(const char *F, aclrtEvent h, int32_t timeout, int has_timeout) {
    LOCKED_CTX(F);
    CHECK(not_in_callback(F));
    if (has_timeout && (timeout == 0 || timeout < -1))
        RET(fail(F, ACL_ERROR_RT_PARAM_INVALID, "timeout %d is invalid (must be -1 or > 0 ms)", timeout));
    event *e;
    CHECK(resolve_event(F, h, &e));
    INJECT(F);
    uint64_t target = e->record_gen;
    struct timespec dl;
    if (has_timeout && timeout > 0) deadline_after(&dl, timeout);
    e->refs++;
    aclError rc = 0;
    while (e->complete_gen < target) {
        if (!has_timeout || timeout < 0) {
            pthread_cond_wait(&g_cond, &g_lock);
        } else if (pthread_cond_timedwait(&g_cond, &g_lock, &dl) == ETIMEDOUT && e->complete_gen < target) {
            rc = fail(F, ACL_ERROR_RT_EVENT_SYNC_TIMEOUT, "event synchronize timed out after %d ms", timeout);
            break;
        }
    }
    unref_event(e);
    RET(rc);
}

EXPORT aclError aclrtSynchronizeEvent(aclrtEvent event) { return sync_event("aclrtSynchronizeEvent", event, -1, 0); }
EXPORT aclError aclrtSynchronizeEventWithTimeout(aclrtEvent event, int32_t timeout) {
    return sync_event("aclrtSynchronizeEventWithTimeout", event, timeout, 1);
}

EXPORT aclError aclrtEventElapsedTime(float *ms, aclrtEvent a, aclrtEvent b) {
    const char *F = "aclrtEventElapsedTime";
    LOCKED_CTX(F);
    if (!ms) RET(fail(F, ACL_ERROR_INVALID_PARAM, "ms is null"));
    event *ea, *eb;
    CHECK(resolve_event(F, a, &ea));
    CHECK(resolve_event(F, b, &eb));
    if (!ea->recorded || !eb->recorded)
        RET(fail(F, ACL_ERROR_RT_INTERNAL_ERROR, "event recorder null: %s event was never recorded",
                 !ea->recorded ? "start" : "end"));
    if (!(ea->flags & ACL_EVENT_TIME_LINE) || !(eb->flags & ACL_EVENT_TIME_LINE))
        RET(fail(F, ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID,
                 "double-only: %s event was created without ACL_EVENT_TIME_LINE (no timestamps)",
                 !(ea->flags & ACL_EVENT_TIME_LINE) ? "start" : "end"));
    if (!event_complete(ea) || !event_complete(eb) || !ea->has_time || !eb->has_time)
        RET(fail(F, ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID,
                 "double-only: %s event has not completed yet (synchronize it first)",
                 !event_complete(ea) || !ea->has_time ? "start" : "end"));
    *ms = (float)(eb->time_ms - ea->time_ms);
    RET(0);
}

/* ------------------------------------------------------------------ memory */
static aclError dev_alloc(const char *F, void **out, size_t size, int pad) {
    LOCKED_CTX(F);
    CHECK(not_in_callback(F));
    if (!out) RET(fail(F, ACL_ERROR_INVALID_PARAM, "devPtr is null"));
    if (size == 0) RET(fail(F, ACL_ERROR_INVALID_PARAM, "Value 0 for size is invalid. size must be greater than zero."));
    INJECT(F);
    int dev = cur_device();
    device *d = &g_dev[dev];
    if (size > g_cfg.memory_bytes)
        RET(fail(F, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of memory: %zu bytes requested, device %d has %zu in total",
                 size, dev, g_cfg.memory_bytes));
    size_t usable = ALIGN_UP(size, 32) + (pad ? 32 : 0);
    size_t reserved = ALIGN_UP(usable, 64);
    size_t off = 0;
    block **pp = &d->blocks;
    while (*pp) {
        if ((*pp)->offset >= off + reserved) break;
        off = (*pp)->offset + (*pp)->reserved;
        pp = &(*pp)->next;
    }
    if (off + reserved > g_cfg.memory_bytes)
        RET(fail(F, ACL_ERROR_RT_MEMORY_ALLOCATION,
                 "out of memory: cannot allocate %zu bytes on device %d (%zu of %zu bytes in use)", size, dev, d->used,
                 g_cfg.memory_bytes));
    block *b = calloc(1, sizeof *b);
    if (!b) RET(fail(F, ACL_ERROR_RT_MEMORY_ALLOCATION, "out of host memory"));
    b->device = dev;
    b->offset = off;
    b->base = d->dev_base + off;
    b->usable = usable;
    b->reserved = reserved;
    b->requested = size;
    b->next = *pp;
    *pp = b;
    d->used += reserved;
    *out = b->base;
    RET(0);
}

EXPORT aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    (void)policy;
    return dev_alloc("aclrtMalloc", devPtr, size, 1);
}
EXPORT aclError aclrtMallocAlign32(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    (void)policy;
    return dev_alloc("aclrtMallocAlign32", devPtr, size, 0);
}

static aclError dev_free(const char *F, void *p, int sync) {
    LOCKED_CTX(F);
    CHECK(not_in_callback(F));
    if (!p) RET(fail(F, ACL_ERROR_INVALID_PARAM, "devPtr is null"));
    INJECT(F);
    int id;
    device *d = dev_of_ptr(p, &id);
    block *b = NULL;
    if (d)
        for (block *x = d->blocks; x; x = x->next)
            if (x->base == (char *)p && !x->freed) b = x;
    if (!b) {
        if (d && find_dev_block(p, 1, 1))
            RET(fail(F, ACL_ERROR_RT_PARAM_INVALID, "double-only: %p is inside an allocation but not its start, or was already freed", p));
        if (d) RET(fail(F, ACL_ERROR_RT_PARAM_INVALID, "double-only: double free or unknown device pointer %p", p));
        if (find_host_block(p))
            RET(fail(F, ACL_ERROR_RT_PARAM_INVALID, "double-only: %p is from aclrtMallocHost (use aclrtFreeHost)", p));
        RET(fail(F, ACL_ERROR_RT_PARAM_INVALID, "double-only: %p is not device memory from aclrtMalloc", p));
    }
    if (sync) wait_device_idle(id);
    if (b->pending > 0)
        b->freed = 1; /* poisoned: queued tasks that use it will fail */
    else
        release_block_storage(b);
    RET(0);
}

EXPORT aclError aclrtFree(void *devPtr) { return dev_free("aclrtFree", devPtr, 0); }
EXPORT aclError aclrtFreeWithDevSync(void *devPtr) { return dev_free("aclrtFreeWithDevSync", devPtr, 1); }

EXPORT aclError aclrtMallocHost(void **hostPtr, size_t size) {
    const char *F = "aclrtMallocHost";
    LOCKED_CTX(F);
    CHECK(not_in_callback(F));
    if (!hostPtr) RET(fail(F, ACL_ERROR_INVALID_PARAM, "hostPtr is null"));
    if (size == 0) RET(fail(F, ACL_ERROR_INVALID_PARAM, "Value 0 for size is invalid. size must be greater than zero."));
    INJECT(F);
    size_t usable = ALIGN_UP(size, 32) + 32;
    void *m = mmap(NULL, usable, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) RET(fail(F, ACL_ERROR_RT_MEMORY_ALLOCATION, "cannot map %zu bytes of host memory", size));
    block *b = calloc(1, sizeof *b);
    b->device = -1;
    b->base = m;
    b->usable = usable;
    b->reserved = usable;
    b->requested = size;
    b->next = g_host_blocks;
    g_host_blocks = b;
    *hostPtr = m;
    RET(0);
}

EXPORT aclError aclrtFreeHost(void *hostPtr) {
    const char *F = "aclrtFreeHost";
    LOCKED_INIT(F);
    CHECK(not_in_callback(F));
    if (!hostPtr) RET(fail(F, ACL_ERROR_INVALID_PARAM, "hostPtr is null"));
    INJECT(F);
    block *b = NULL;
    for (block *x = g_host_blocks; x; x = x->next)
        if (x->base == (char *)hostPtr && !x->freed) b = x;
    if (!b)
        RET(fail(F, ACL_ERROR_RT_PARAM_INVALID,
                 "double-only: %p is not (or no longer) a pointer returned by aclrtMallocHost", hostPtr));
    if (b->pending > 0)
        b->freed = 1;
    else
        release_block_storage(b);
    RET(0);
}

EXPORT aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *freeB, size_t *total) {
    const char *F = "aclrtGetMemInfo";
    LOCKED_CTX(F);
    if (!freeB || !total) RET(fail(F, ACL_ERROR_INVALID_PARAM, "null out-pointer"));
    if (attr < 0 || attr > 17) RET(fail(F, ACL_ERROR_INVALID_PARAM, "unknown memory attribute %d", attr));
    device *d = &g_dev[cur_device()];
    *total = g_cfg.memory_bytes;
    *freeB = g_cfg.memory_bytes - d->used;
    RET(0);
}

/* Where a pointer lives: 1 = device, 0 = host. */
static int is_dev(const void *p) { return dev_of_ptr(p, NULL) != NULL; }

static const char *kind_name(int k) {
    static const char *n[] = {"HOST_TO_HOST", "HOST_TO_DEVICE", "DEVICE_TO_HOST", "DEVICE_TO_DEVICE"};
    return k >= 0 && k < 4 ? n[k] : "?";
}

/* device side must be inside a live allocation */
static aclError check_dev_range(const char *F, const char *what, const void *p, size_t n, block **out) {
    block *b = find_dev_block(p, n, 0);
    if (!b) {
        block *any = find_dev_block(p, 1, 1);
        if (any && any->freed)
            return fail(F, ACL_ERROR_RT_PARAM_INVALID, "double-only: %s %p is in device memory already freed", what, p);
        return fail(F, ACL_ERROR_RT_PARAM_INVALID,
                    "double-only: %s range [%p, +%zu) is not inside one live device allocation (padding included)",
                    what, p, n);
    }
    *out = b;
    return 0;
}

EXPORT aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind) {
    const char *F = "aclrtMemcpy";
    LOCKED_CTX(F);
    if (!dst || !src) RET(fail(F, ACL_ERROR_INVALID_PARAM, "%s is null", !dst ? "dst" : "src"));
    if ((int)kind < 0 || (int)kind > 7) RET(fail(F, ACL_ERROR_INVALID_PARAM, "invalid memcpy kind %d", (int)kind));
    if (count > destMax)
        RET(fail(F, ACL_ERROR_RT_PARAM_INVALID, "count %zu is greater than destMax %zu", count, destMax));
    if (count == 0 || dst == src) RET(0);
    INJECT(F);
    int dd = is_dev(dst), sd = is_dev(src);
    block *bd = NULL, *bs = NULL;
    if (dd) CHECK(check_dev_range(F, "dst", dst, count, &bd));
    if (sd) CHECK(check_dev_range(F, "src", src, count, &bs));
    /* blocking copy; the blocks cannot go away during it: we pin them */
    if (bd) bd->pending++;
    if (bs) bs->pending++;
    pthread_mutex_unlock(&g_lock);
    pthread_mutex_lock(&g_lock);
    char *d = dd ? rw_addr(dst) : dst;
    const char *s = sd ? rw_addr(src) : src;
    pthread_mutex_unlock(&g_lock);
    double began = mono_ns();
    memmove(d, s, count);
    model_copy(began, count);
    pthread_mutex_lock(&g_lock);
    unref_block(bd);
    unref_block(bs);
    RET(0);
}

EXPORT aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind,
                                 aclrtStream sh) {
    const char *F = "aclrtMemcpyAsync";
    LOCKED_CTX(F);
    CHECK(not_in_callback(F));
    stream *s;
    CHECK(resolve_stream(F, sh, &s));
    if (!dst || !src) RET(fail(F, ACL_ERROR_INVALID_PARAM, "%s is null", !dst ? "dst" : "src"));
    if ((int)kind < 0 || (int)kind > 7) RET(fail(F, ACL_ERROR_INVALID_PARAM, "invalid memcpy kind %d", (int)kind));
    if (count > destMax)
        RET(fail(F, ACL_ERROR_RT_PARAM_INVALID, "count %zu is greater than destMax %zu", count, destMax));
    if (count == 0 || dst == src) RET(0);
    CHECK(stream_accepts(F, s));
    INJECT(F);
    int dd = is_dev(dst), sd = is_dev(src);
    int actual = (sd ? 2 : 0) | (dd ? 1 : 0); /* 0 H2H, 1 H2D, 2 D2H, 3 D2D */
    if (actual == 0 || kind == ACL_MEMCPY_HOST_TO_HOST) {
        if (actual == 0)
            RET(fail(F, ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "asynchronous HOST_TO_HOST copy is not supported"));
    }
    int given = kind == ACL_MEMCPY_DEFAULT ? actual
                : kind == ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE ? 1
                : (kind == ACL_MEMCPY_INNER_DEVICE_TO_DEVICE || kind == ACL_MEMCPY_INTER_DEVICE_TO_DEVICE) ? 3
                                                                                                          : (int)kind;
    if (given != actual && !g_cfg.compat)
        RET(fail(F, ACL_ERROR_RT_PARAM_INVALID,
                 "double-only (strict mode): kind %s contradicts the pointers (dst is %s memory, src is %s memory: %s)",
                 kind_name(given), dd ? "device" : "host", sd ? "device" : "host", kind_name(actual)));
    block *bd = NULL, *bs = NULL;
    if (dd) CHECK(check_dev_range(F, "dst", dst, count, &bd));
    if (sd) CHECK(check_dev_range(F, "src", src, count, &bs));
    if (((uintptr_t)dst & 63) || ((uintptr_t)src & 63))
        RET(fail(F, ACL_ERROR_RT_ADDR_UNALIGNED,
                 "double-only: aclrtMemcpyAsync %s %p is not 64-byte aligned (CANN <= 8.1 rule; current CANN only "
                 "documents it for on-chip D2D)",
                 ((uintptr_t)dst & 63) ? "dst" : "src", ((uintptr_t)dst & 63) ? dst : src));
    const void *host = !dd ? (const void *)dst : (!sd ? src : NULL);
    block *bh = NULL;
    if (host) {
        bh = find_host_block(host);
        if (bh && (size_t)((const char *)host - bh->base) + count > bh->usable)
            RET(fail(F, ACL_ERROR_RT_PARAM_INVALID,
                     "double-only: host range [%p, +%zu) runs past its aclrtMallocHost allocation", host, count));
        if (!bh) {
            if (!g_cfg.compat)
                RET(fail(F, ACL_ERROR_RT_PARAM_INVALID,
                         "double-only: pageable host memory in an async copy (CANN >=8.5 silently synchronizes the "
                         "stream instead); host pointer %p is not from aclrtMallocHost (ACLDOUBLE_MODE=compat "
                         "emulates CANN 8.5)",
                         host));
            /* compat: synchronize the stream, then copy synchronously (CANN >= 8.5) */
            if (bd) bd->pending++;
            if (bs) bs->pending++;
            stream_wait(s, -1);
            pthread_mutex_unlock(&g_lock);
            pthread_mutex_lock(&g_lock);
            char *d = dd ? rw_addr(dst) : dst;
            const char *sp = sd ? rw_addr(src) : src;
            pthread_mutex_unlock(&g_lock);
            double began = mono_ns();
            memmove(d, sp, count);
            model_copy(began, count);
            pthread_mutex_lock(&g_lock);
            unref_block(bd);
            unref_block(bs);
            RET(0);
        }
    }
    task *t = calloc(1, sizeof *t);
    t->kind = T_COPY;
    t->dst = dst;
    t->src = src;
    t->n = count;
    t->refs[0] = dd ? bd : (host == dst ? bh : NULL);
    t->refs[1] = sd ? bs : (host == src ? bh : NULL);
    if (t->refs[0]) t->refs[0]->pending++;
    if (t->refs[1]) t->refs[1]->pending++;
    enqueue(s, t);
    RET(0);
}

static aclError memset_common(const char *F, void *p, size_t maxCount, int32_t value, size_t count, int async,
                              aclrtStream sh) {
    LOCKED_CTX(F);
    stream *s = NULL;
    if (async) {
        CHECK(not_in_callback(F));
        CHECK(resolve_stream(F, sh, &s));
    }
    if (!p) RET(fail(F, ACL_ERROR_INVALID_PARAM, "devPtr is null"));
    if (count > maxCount)
        RET(fail(F, ACL_ERROR_RT_PARAM_INVALID, "count %zu is greater than maxCount %zu", count, maxCount));
    if (count == 0) RET(0);
    if (s) CHECK(stream_accepts(F, s));
    INJECT(F);
    block *b = NULL;
    if (is_dev(p)) {
        CHECK(check_dev_range(F, "devPtr", p, count, &b));
    } else {
        b = find_host_block(p);
        if (!b || (size_t)((char *)p - b->base) + count > b->usable)
            RET(fail(F, ACL_ERROR_RT_PARAM_INVALID,
                     "double-only: %s on host memory [%p, +%zu) not from aclrtMallocHost (undefined behaviour)", F, p,
                     count));
    }
    if (!async) {
        char *d = b->device >= 0 ? rw_addr(p) : p;
        memset(d, value, count);
        RET(0);
    }
    task *t = calloc(1, sizeof *t);
    t->kind = T_MEMSET;
    t->dst = p;
    t->n = count;
    t->value = value;
    t->refs[0] = b;
    b->pending++;
    enqueue(s, t);
    RET(0);
}

EXPORT aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count) {
    return memset_common("aclrtMemset", devPtr, maxCount, value, count, 0, NULL);
}
EXPORT aclError aclrtMemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count, aclrtStream stream) {
    return memset_common("aclrtMemsetAsync", devPtr, maxCount, value, count, 1, stream);
}

/* ------------------------------------------------------------------ callbacks */
static reporter *find_reporter(uint64_t tid) {
    for (reporter *r = g_reporters; r; r = r->next)
        if (r->tid == tid) return r;
    return NULL;
}

EXPORT aclError aclrtSubscribeReport(uint64_t threadId, aclrtStream sh) {
    const char *F = "aclrtSubscribeReport";
    LOCKED_CTX(F);
    stream *s;
    CHECK(resolve_stream(F, sh, &s));
    if (s->subscribed)
        RET(fail(F, ACL_ERROR_RT_STREAM_SUBSCRIBE, "stream %p already has a report thread (%" PRIu64 ")", (void *)s,
                 s->sub_tid));
    if (s->used_hostfunc)
        RET(fail(F, ACL_ERROR_RT_STREAM_SUBSCRIBE,
                 "stream %p already used aclrtLaunchHostFunc: do not mix it with the report-callback family",
                 (void *)s));
    INJECT(F);
    reporter *r = find_reporter(threadId);
    if (r && r->device != s->device)
        RET(fail(F, ACL_ERROR_RT_THREAD_SUBSCRIBE, "thread %" PRIu64 " already reports for device %d, not %d",
                 threadId, r->device, s->device));
    if (!r) {
        r = calloc(1, sizeof *r);
        r->tid = threadId;
        r->device = s->device;
        r->next = g_reporters;
        g_reporters = r;
    }
    r->nstreams++;
    s->subscribed = 1;
    s->sub_tid = threadId;
    g_nsubs++;
    RET(0);
}

EXPORT aclError aclrtUnSubscribeReport(uint64_t threadId, aclrtStream sh) {
    const char *F = "aclrtUnSubscribeReport";
    LOCKED_CTX(F);
    stream *s;
    CHECK(resolve_stream(F, sh, &s));
    if (!s->subscribed || s->sub_tid != threadId)
        RET(fail(F, ACL_ERROR_RT_THREAD_SUBSCRIBE, "thread %" PRIu64 " is not subscribed to stream %p", threadId,
                 (void *)s));
    /* callbacks already queued on the stream are delivered first (the real runtime syncs here too) */
    stream_wait(s, -1);
    s->subscribed = 0;
    g_nsubs--;
    reporter *r = find_reporter(threadId);
    if (r) r->nstreams--;
    RET(0);
}

EXPORT aclError aclrtLaunchCallback(aclrtCallback fn, void *userData, aclrtCallbackBlockType blockType,
                                    aclrtStream sh) {
    const char *F = "aclrtLaunchCallback";
    LOCKED_CTX(F);
    CHECK(not_in_callback(F));
    if (!fn) RET(fail(F, ACL_ERROR_INVALID_PARAM, "fn is null"));
    if ((int)blockType != 0 && (int)blockType != 1)
        RET(fail(F, ACL_ERROR_INVALID_PARAM, "invalid blockType %d", (int)blockType));
    stream *s;
    CHECK(resolve_stream(F, sh, &s));
    if (s->used_hostfunc)
        RET(fail(F, ACL_ERROR_RT_STREAM_SUBSCRIBE,
                 "stream %p already used aclrtLaunchHostFunc: do not mix it with aclrtLaunchCallback", (void *)s));
    if (!s->subscribed)
        RET(fail(F, ACL_ERROR_RT_STREAM_NO_CB_REG,
                 "stream %p has no report thread: call aclrtSubscribeReport first", (void *)s));
    CHECK(stream_accepts(F, s));
    INJECT(F);
    task *t = calloc(1, sizeof *t);
    t->kind = T_CALLBACK;
    t->cb = fn;
    t->data = userData;
    t->cb_block = (int)blockType;
    s->used_callback = 1;
    enqueue(s, t);
    RET(0);
}

EXPORT aclError aclrtLaunchHostFunc(aclrtStream sh, aclrtHostFunc fn, void *args) {
    const char *F = "aclrtLaunchHostFunc";
    LOCKED_CTX(F);
    CHECK(not_in_callback(F));
    if (!fn) RET(fail(F, ACL_ERROR_INVALID_PARAM, "fn is null"));
    stream *s;
    CHECK(resolve_stream(F, sh, &s));
    if (s->subscribed || s->used_callback)
        RET(fail(F, ACL_ERROR_RT_STREAM_SUBSCRIBE,
                 "stream %p uses the report-callback family: do not mix it with aclrtLaunchHostFunc", (void *)s));
    CHECK(stream_accepts(F, s));
    INJECT(F);
    task *t = calloc(1, sizeof *t);
    t->kind = T_HOSTFUNC;
    t->cb = fn;
    t->data = args;
    s->used_hostfunc = 1;
    enqueue(s, t);
    RET(0);
}

EXPORT aclError aclrtProcessReport(int32_t timeout) {
    const char *F = "aclrtProcessReport";
    LOCKED_INIT(F);
    if (timeout == 0 || timeout < -1)
        RET(fail(F, ACL_ERROR_INVALID_PARAM, "timeout %d is invalid (must be -1 or > 0 ms)", timeout));
    uint64_t me = (uint64_t)pthread_self();
    if (!find_reporter(me))
        RET(fail(F, ACL_ERROR_RT_THREAD_SUBSCRIBE, "thread %" PRIu64 " is not subscribed to any stream", me));
    uint64_t gen = g_gen;
    struct timespec dl;
    if (timeout > 0) deadline_after(&dl, timeout);
    reporter *r;
    for (;;) {
        if (g_gen != gen || g_shutdown)
            RET(fail(F, ACL_ERROR_UNINITIALIZE, "double-only: aclFinalize while waiting for callbacks"));
        r = find_reporter(me);
        if (!r) RET(fail(F, ACL_ERROR_RT_THREAD_SUBSCRIBE, "thread %" PRIu64 " was unsubscribed", me));
        if (r->head) break;
        if (timeout < 0)
            pthread_cond_wait(&g_cond, &g_lock);
        else if (pthread_cond_timedwait(&g_cond, &g_lock, &dl) == ETIMEDOUT) {
            r = find_reporter(me);
            if (r && r->head) break;
            RET(fail(F, ACL_ERROR_RT_REPORT_TIMEOUT, "no callback to process within %d ms", timeout));
        }
    }
    cb_item *it = r->head;
    r->head = it->next;
    if (!r->head) r->tail = NULL;
    pthread_mutex_unlock(&g_lock);
    t_in_callback = 1;
    it->fn(it->data);
    t_in_callback = 0;
    pthread_mutex_lock(&g_lock);
    if (it->block && g_gen == gen) {
        it->done = 1;
        pthread_cond_broadcast(&g_cond);
    } else {
        free(it);
    }
    RET(0);
}

/* ------------------------------------------------------------------ internal API */
EXPORT int acldouble_enqueue_kernel(void *sh, const char *name, int (*run)(void *ctx), void *ctx,
                                    void (*release)(void *ctx)) {
    const char *F = "acldouble_enqueue_kernel";
    LOCKED_CTX(F);
    CHECK(not_in_callback(F));
    if (!run) RET(fail(F, ACL_ERROR_INVALID_PARAM, "run is null"));
    stream *s;
    CHECK(resolve_stream(F, sh, &s));
    CHECK(stream_accepts(F, s));
    INJECT(F);
    task *t = calloc(1, sizeof *t);
    t->kind = T_KERNEL;
    strncpy(t->name, name ? name : "kernel", sizeof t->name - 1); /* calloc'd: stays terminated */
    t->run = run;
    t->data = ctx;
    t->release = release;
    enqueue(s, t);
    RET(0);
}

EXPORT void *acldouble_device_view(const void *devptr, size_t bytes) {
    if (!t_worker) {
        fail("acldouble_device_view", ACL_ERROR_RT_PARAM_INVALID,
             "double-only: device memory may only be viewed from a stream worker");
        return NULL;
    }
    pthread_mutex_lock(&g_lock);
    void *r = NULL;
    if (devptr && find_dev_block(devptr, bytes ? bytes : 1, 0)) r = rw_addr(devptr);
    pthread_mutex_unlock(&g_lock);
    return r;
}

EXPORT int acldouble_injected(const char *func) {
    pthread_once(&g_once, init_once);
    pthread_mutex_lock(&g_lock);
    int code = injected(func);
    pthread_mutex_unlock(&g_lock);
    return code;
}

EXPORT int acldouble_is_device_range(const void *p, size_t bytes) {
    pthread_mutex_lock(&g_lock);
    int r = g_init_count && p && find_dev_block(p, bytes ? bytes : 1, 0) != NULL;
    pthread_mutex_unlock(&g_lock);
    return r;
}
