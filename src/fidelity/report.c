/* fidelity/report: JSON and HTML writers (contract in report.h). */
#include "fidelity/report.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "fidelity/common.h"

void fid_results_score(const fid_results *r, int *done, int *pass) {
    *done = *pass = 0;
    for (int i = 0; i < r->n_items; i++) {
        *done += r->items[i].done;
        *pass += r->items[i].done && r->items[i].pass;
    }
}

static const char *MEANINGLESS =
    "These scores are meaningless: the local model has random (synthetic) weights, so it cannot "
    "recall anything.  The run proves only that prompts, requests and grading work.  Pass "
    "--real-weights when the checkpoint is a real one.";

/* ----- JSON ----- */
int fid_results_write_json(const fid_results *r, const char *path, dsv4_err *err) {
    FILE *f = fopen(path, "w");
    if (!f) return dsv4_errf(err, "%s: %s", path, strerror(errno));
    int done, pass;
    fid_results_score(r, &done, &pass);
    fprintf(f, "{\"suite\":\"%s\",\"target\":", r->suite);
    fid_json_str(f, r->target);
    fprintf(f, ",\"local\":%s,\"meaningless\":%s,", r->local ? "true" : "false", r->meaningless ? "true" : "false");
    if (r->meaningless) {
        fprintf(f, "\"note\":");
        fid_json_str(f, MEANINGLESS);
        fputc(',', f);
    }
    fprintf(f, "\"seed\":%llu,\"samples\":%d,", (unsigned long long)r->seed, r->samples);
    int needle = !strcmp(r->suite, "needle");
    fprintf(f, "\"%s\":[", needle ? "lengths" : "turns");
    for (int i = 0; i < r->n_a; i++) fprintf(f, "%s%d", i ? "," : "", r->axis_a[i]);
    fprintf(f, "],");
    if (needle) {
        fprintf(f, "\"depths\":[");
        for (int i = 0; i < r->n_b; i++) fprintf(f, "%s%d", i ? "," : "", r->axis_b[i]);
        fprintf(f, "],");
    } else
        fprintf(f, "\"tool_tokens\":%d,", r->tool_tokens);
    fprintf(f, "\"planned\":%d,\"requests\":%d,\"answered\":%d,\"passed\":%d,\"score\":", r->n_items, r->n_run, done,
            pass);
    if (done) fprintf(f, "%.6f", (double)pass / done);
    else fprintf(f, "null");
    fprintf(f, ",\"incomplete\":%s,\"stop_reason\":", r->incomplete ? "true" : "false");
    if (r->stop_reason[0]) fid_json_str(f, r->stop_reason);
    else fprintf(f, "null");
    fprintf(f, ",\"seconds\":%.3f,\"items\":[", r->secs);
    for (int i = 0; i < r->n_items; i++) {
        const fid_item *it = &r->items[i];
        if (needle)
            fprintf(f, "%s\n{\"length\":%d,\"depth\":%d,", i ? "," : "", r->axis_a[it->a], r->axis_b[it->b]);
        else
            fprintf(f, "%s\n{\"turns\":%d,\"conversation\":%d,", i ? "," : "", r->axis_a[it->a], it->b);
        fprintf(f, "\"key\":");
        fid_json_str(f, it->key);
        fprintf(f, ",\"expect\":");
        fid_json_str(f, it->expect);
        if (!it->done && !it->error[0]) {
            fprintf(f, ",\"status\":\"not run\"}");
            continue;
        }
        if (it->done) {
            fprintf(f, ",\"status\":\"answered\",\"pass\":%s,\"answer\":", it->pass ? "true" : "false");
            fid_json_str(f, it->answer);
        } else {
            fprintf(f, ",\"status\":\"error\",\"error\":");
            fid_json_str(f, it->error);
        }
        fprintf(f, ",\"prompt_tokens\":%lld,\"seconds\":%.3f}", (long long)it->prompt_tokens, it->secs);
    }
    fprintf(f, "\n]}\n");
    if (fclose(f)) return dsv4_errf(err, "%s: write error", path);
    return 0;
}

/* ----- HTML ----- */
/* score 0..1 -> red (0) .. yellow .. green (1) */
static void heat_color(double s, char *buf, size_t n) {
    int r, g;
    if (s < 0.5) r = 215, g = (int)(48 + s * 2 * (190 - 48));
    else r = (int)(215 - (s - 0.5) * 2 * (215 - 26)), g = (int)(190 - (s - 0.5) * 2 * (190 - 150));
    snprintf(buf, n, "rgb(%d,%d,%d)", r, g, s < 0.5 ? 39 : (int)(39 + (s - 0.5) * 2 * 30));
}

static void heatmap(FILE *f, const fid_results *r) {
    const int cw = 84, ch = 44, x0 = 90, y0 = 40;
    int W = x0 + cw * r->n_a + 20, H = y0 + ch * r->n_b + 60;
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" role=\"img\" "
               "aria-label=\"needle recall heatmap\" font-family=\"sans-serif\" font-size=\"13\">\n", W, H);
    fprintf(f, "<text x=\"%d\" y=\"20\" font-weight=\"bold\">recall by context length (x) and needle depth (y)</text>\n",
            x0);
    for (int j = 0; j < r->n_b; j++) {
        fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%d%%</text>\n", x0 - 8, y0 + ch * j + ch / 2 + 4,
                r->axis_b[j]);
        for (int i = 0; i < r->n_a; i++) {
            int n = 0, p = 0, err = 0;
            for (int k = 0; k < r->n_items; k++) {
                const fid_item *it = &r->items[k];
                if (it->a != i || it->b != j) continue;
                n += it->done, p += it->done && it->pass, err += !it->done && it->error[0];
            }
            char col[32] = "#e0e0e0", label[32] = "not run";
            if (n) {
                heat_color((double)p / n, col, sizeof col);
                snprintf(label, sizeof label, "%d%%", 100 * p / n);
            } else if (err)
                snprintf(label, sizeof label, "error");
            fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\" stroke=\"white\"><title>length "
                       "%d, depth %d%%: %d/%d</title></rect>\n", x0 + cw * i, y0 + ch * j, cw, ch, col, r->axis_a[i],
                    r->axis_b[j], p, n);
            fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"%s\">%s</text>\n", x0 + cw * i + cw / 2,
                    y0 + ch * j + ch / 2 + 4, n ? "white" : "#555", label);
        }
    }
    for (int i = 0; i < r->n_a; i++)
        fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">%d</text>\n", x0 + cw * i + cw / 2,
                y0 + ch * r->n_b + 18, r->axis_a[i]);
    fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">context length (approx. tokens)</text>\n",
            x0 + cw * r->n_a / 2, y0 + ch * r->n_b + 40);
    fprintf(f, "</svg>\n");
}

int fid_results_write_html(const fid_results *r, const char *path, dsv4_err *err) {
    FILE *f = fopen(path, "w");
    if (!f) return dsv4_errf(err, "%s: %s", path, strerror(errno));
    int done, pass, needle = !strcmp(r->suite, "needle");
    fid_results_score(r, &done, &pass);
    fprintf(f, "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>dsv4 fidelity %s</title>\n"
               "<style>\nbody{font-family:sans-serif;margin:24px;color:#222}\n"
               ".warn{background:#fff3cd;border:2px solid #d39e00;padding:12px 16px;font-size:17px;margin:12px 0}\n"
               ".bad{background:#f8d7da;border:2px solid #c82333;padding:12px 16px;margin:12px 0}\n"
               "table{border-collapse:collapse;margin:12px 0}td,th{border:1px solid #ccc;padding:4px 8px;"
               "font-size:13px;text-align:left}\n.pass{color:#1a7f37}.fail{color:#c82333}\n</style>\n</head>\n<body>\n",
            r->suite);
    fprintf(f, "<h1>dsv4 fidelity: %s</h1>\n", needle ? "needle in a haystack" : "multi-turn recall");
    if (r->meaningless) {
        fprintf(f, "<div class=\"warn\" id=\"meaningless\"><strong>Note:</strong> ");
        fid_html_str(f, MEANINGLESS);
        fprintf(f, "</div>\n");
    }
    if (r->incomplete) {
        fprintf(f, "<div class=\"bad\"><strong>Incomplete run</strong> (partial results below): ");
        fid_html_str(f, r->stop_reason);
        fprintf(f, "</div>\n");
    }
    fprintf(f, "<p>Target: <code>");
    fid_html_str(f, r->target);
    fprintf(f, "</code><br>Seed %llu; %d of %d planned requests sent in %.1f s; score <strong>%d/%d", 
            (unsigned long long)r->seed, r->n_run, r->n_items, r->secs, pass, done);
    if (done) fprintf(f, " (%.1f%%)", 100.0 * pass / done);
    fprintf(f, "</strong> (exact match of the 6-digit number).</p>\n");
    if (needle) heatmap(f, r);
    else {
        fprintf(f, "<table>\n<tr><th>turns</th><th>tool result size (approx. tokens)</th><th>conversations</th>"
                   "<th>recalled</th><th>score</th></tr>\n");
        for (int i = 0; i < r->n_a; i++) {
            int n = 0, p = 0;
            for (int k = 0; k < r->n_items; k++)
                if (r->items[k].a == i) n += r->items[k].done, p += r->items[k].done && r->items[k].pass;
            fprintf(f, "<tr><td>%d</td><td>%d</td><td>%d</td><td>%d</td><td>", r->axis_a[i], r->tool_tokens, n, p);
            if (n) fprintf(f, "%.0f%%", 100.0 * p / n);
            else fprintf(f, "-");
            fprintf(f, "</td></tr>\n");
        }
        fprintf(f, "</table>\n");
    }
    fprintf(f, "<h2>Requests</h2>\n<table>\n<tr><th>%s</th><th>%s</th><th>prompt tokens</th><th>expected</th>"
               "<th>answer</th><th>result</th></tr>\n", needle ? "length" : "turns",
            needle ? "depth" : "conversation");
    for (int k = 0; k < r->n_items; k++) {
        const fid_item *it = &r->items[k];
        if (!it->done && !it->error[0]) continue;
        fprintf(f, "<tr><td>%d</td><td>%d%s</td><td>", r->axis_a[it->a], needle ? r->axis_b[it->b] : it->b,
                needle ? "%" : "");
        if (it->prompt_tokens >= 0) fprintf(f, "%lld", (long long)it->prompt_tokens);
        else fprintf(f, "?");
        fprintf(f, "</td><td>");
        fid_html_str(f, it->expect);
        fprintf(f, "</td><td><code>");
        fid_html_str(f, it->done ? it->answer : it->error);
        fprintf(f, "</code></td><td class=\"%s\">%s</td></tr>\n", it->done && it->pass ? "pass" : "fail",
                it->done ? (it->pass ? "pass" : "fail") : "error");
    }
    fprintf(f, "</table>\n</body>\n</html>\n");
    if (fclose(f)) return dsv4_errf(err, "%s: write error", path);
    return 0;
}
