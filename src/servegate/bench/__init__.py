"""`servegate bench`: compare serving targets side by side on one seeded workload.

The field's tools measure one endpoint at a time; this one sends the same requests to
several targets in alternating rounds, so machine drift hits each equally, and reads
the replicas' own prefix-cache counters for the true cluster hit rate.

Modules: `text` (seeded words, no downloads), `workloads` and `trace` (what to send),
`client` (one request, measured), `runner` (load shapes, targets in alternation),
`engine_counters` (replica `/metrics`), `stats` and `report` (numbers, tables, plots),
`cli` (the typer command). The standard routing comparison behind `make bench`:
`policies` (the picker configs compared), `gateway_process` (a `servegate serve`
child per policy), `standard` (cluster, run, docs section), `docs_section` (markers).
"""
