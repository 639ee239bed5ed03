"""The request path both data planes share: from a parsed request to a decision and back.

`Director` runs the steps (rewrite → pool → flow control → candidates → routing
tokenisation → SLO admission → schedule → lease → completion bookkeeping) over the
`RoutingSnapshot` a request read at its start; a `RequestContext` carries one request
through them; a `Lease` holds its in-flight counts until it is released, once. The HTTP
gateway (`gateway/app.py`) and the ext_proc picker (`extproc/stream.py`) are adapters that
read bytes from their wire, call the Director and write its answer back, so a feature
built here works in both. Nothing in this package imports an HTTP or gRPC framework.
"""
