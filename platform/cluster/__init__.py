"""Scale-out on Ray Serve: an ingress deployment (the FastAPI app: auth, limits, OpenAI and admin routes)
in front of engine replicas, each running one engine, reached through Ray Serve's model multiplexing keyed
by the adapter version's digest and a request router that prefers the replica where the adapter already is
(device, then host RAM, then a free device slot, then one it can evict: `loramux.cluster.residency_router`).

Ray is an optional extra (`pip install loramux[ray]`): nothing here is imported by the single-process
server, and only `loramux.cluster.app` and `loramux.cluster.residency_router` import Ray itself.
"""
