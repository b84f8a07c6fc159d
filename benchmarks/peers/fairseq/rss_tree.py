#!/usr/bin/env python
"""Run a command; sample the summed RSS (and PSS) of its whole process tree every 0.2 s.
Prints 'TREE_PEAK_RSS_KB <n>' and 'TREE_MAX_PROCS <n>' to stderr at the end."""
import os, subprocess, sys, time

def children_map():
    m = {}
    for d in os.listdir("/proc"):
        if not d.isdigit(): continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
            ppid = int(s[s.rfind(")") + 2:].split()[1])
            m.setdefault(ppid, []).append(int(d))
        except Exception:
            pass
    return m

def field_kb(path, key):
    """The value in kB of the line ``key`` of a /proc file (0 if the process is gone)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except Exception:
        pass
    return 0

def rss_kb(pid):
    return field_kb(f"/proc/{pid}/status", "VmRSS:")

def pss_kb(pid):
    return field_kb(f"/proc/{pid}/smaps_rollup", "Pss:")

def tree(pid):
    """(summed RSS kB, summed PSS kB, processes) of ``pid`` and all its descendants."""
    m = children_map()
    stack = [pid]; tot = 0; n = 0; pss = 0
    while stack:
        q = stack.pop(); tot += rss_kb(q); pss += pss_kb(q); n += 1
        stack.extend(m.get(q, []))
    return tot, pss, n

if __name__ == "__main__":
    p = subprocess.Popen(sys.argv[1:])
    peak = 0; maxn = 0; peakpss = 0
    while p.poll() is None:
        tot, pss, n = tree(p.pid)
        peak = max(peak, tot); maxn = max(maxn, n); peakpss = max(peakpss, pss)
        time.sleep(0.2)
    print(f"TREE_PEAK_RSS_KB {peak}", file=sys.stderr)
    print(f"TREE_PEAK_PSS_KB {peakpss}", file=sys.stderr)
    print(f"TREE_MAX_PROCS {maxn}", file=sys.stderr)
    sys.exit(p.returncode)
