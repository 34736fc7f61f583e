import json, sys, glob
for path in sys.argv[1:]:
  try:
    rows = json.load(open(path))["rows"]
  except Exception as e:
    print(path, "unreadable", e); continue
  for r in rows:
    keys = [k[:-3] for k in r if k.endswith("_us") and isinstance(r[k], float)]
    parts = []
    for k in keys:
      extra = ""
      if k.startswith("ours"):
        cfg = r.get(f"{k}_config") or {}
        extra = "[s%s%s %s]%s%s" % (cfg.get("sender_sms"), "k" if cfg.get("k_major_sends") else "",
                            cfg.get("tile_n"), "" if r.get(f"{k}_repeat_identical") else " NOTREP",
                            " err%.1e" % r[f"{k}_rel_err"] if f"{k}_rel_err" in r else "") + (" LB" if r.get(f"{k}_loopback") else "") + (" g%s" % cfg.get("send_gap") if not cfg.get("sender_sms") else " p%s l%s" % (cfg.get("sender_row_parts", 1), cfg.get("sender_announce_lag")))
      parts.append(f"{k}={r[k + '_us']:.1f}{extra}")
    print(r.get("pattern", "ag")[:2], r["shape"], " ".join(parts))
