#include "util/paths.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int dsv4_exe_dir(char *out, size_t cap) {
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return -1;
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (!slash) return -1;
    *slash = '\0';
    if ((size_t)snprintf(out, cap, "%s", exe) >= cap) return -1;
    return 0;
}

int dsv4_default_tokenizer_path(char *out, size_t cap) {
    const char *env = getenv("DSV4_TOKENIZER");
    if (env && *env) return (size_t)snprintf(out, cap, "%s", env) < cap ? 0 : -1;
    char dir[4096];
    if (dsv4_exe_dir(dir, sizeof dir)) return -1;
    static const char *const rel[] = {"../data/tokenizer/tokenizer.json", "../../data/tokenizer/tokenizer.json"};
    for (size_t i = 0; i < sizeof rel / sizeof rel[0]; i++) {
        if ((size_t)snprintf(out, cap, "%s/%s", dir, rel[i]) >= cap) continue;
        if (access(out, R_OK) == 0) return 0;
    }
    return -1;
}
