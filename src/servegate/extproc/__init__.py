"""Gateway API Inference Extension mode: servegate as Envoy's endpoint picker over ext_proc.

    Envoy ──ext_proc stream──▶ server.py (gRPC, health, metrics)
                                  └─ stream.py   one request: hold the body, answer in order,
                                       │              routed by control/director.py
                                       ├─ picker.py   destinations and sidecar headers
                                       ├─ protocol.py the wire: headers, metadata, messages
                                       └─ usage.py    token usage beside the relayed response
    client.py  Envoy's side of the protocol, for tests and the benchmark
    cli.py     `servegate extproc`

The Director, pools, data layers, schedulers, flow control and metrics are the HTTP
gateway's own (`gateway.app.build_gateway`): one request path, two data planes.
"""
