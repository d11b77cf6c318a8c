// fileio.h: what every reader of an untrusted file shares: one-line error messages, and regular
// files mapped read-only. Plain C11 that also compiles as C++17.
#ifndef FILEIO_H
#define FILEIO_H

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

// Formats an error message into err and returns -1. The message stays one line whatever it quotes
// from a damaged file: control characters (a newline in a name, say) become '?'.
static inline int error_line(char *err, size_t err_len, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(err, err_len, fmt, args);
    va_end(args);
    for (char *c = err; err_len && *c; c++)
        if ((unsigned char)*c < 0x20 || *c == 0x7f) *c = '?';
    return -1;
}

// A regular file mapped read-only; an empty file is NULL and 0 bytes.
typedef struct {
    const uint8_t *bytes;
    uint64_t size;
} MappedFile;

// Maps file `path` of folder `dir` (a handle, or AT_FDCWD), which must be a regular file; `what`
// and `shown` name it in messages. O_NONBLOCK: opening a FIFO or a device returns at once, to be
// refused, instead of waiting for a writer; it changes nothing for a regular file. The mapping
// stays whole when the file is renamed or deleted. Returns 0, or -1 with a message.
static inline int map_regular_file_at(int dir, const char *path, const char *shown, const char *what, MappedFile *m, char *err,
                                      size_t err_len) {
    memset(m, 0, sizeof *m);
    int fd = openat(dir, path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return error_line(err, err_len, "cannot open %s %s: %s", what, shown, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return error_line(err, err_len, "%s %s is not a regular file", what, shown);
    }
    uint64_t size = (uint64_t)st.st_size;
    void *map = size ? mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0) : NULL;
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED) return error_line(err, err_len, "cannot map %s %s: %s", what, shown, strerror(map_errno));
    m->bytes = (const uint8_t *)map, m->size = size;
    return 0;
}

static inline int map_regular_file(const char *path, const char *what, MappedFile *m, char *err, size_t err_len) {
    return map_regular_file_at(AT_FDCWD, path, path, what, m, err, err_len);
}

static inline void unmap_file(MappedFile *m) {
    if (m->bytes) munmap((void *)m->bytes, m->size);
    memset(m, 0, sizeof *m);
}

#endif  // FILEIO_H
