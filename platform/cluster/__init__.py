"""Scale-out on Ray Serve: an ingress deployment (the FastAPI app: auth, limits, OpenAI and admin routes)
in front of engine replicas, each running one engine, reached through Ray Serve's model multiplexing keyed
by the adapter version's digest, so a replica that already holds an adapter is preferred.

Ray is an optional extra (`pip install loramux[ray]`): nothing here is imported by the single-process
server, and only `loramux.cluster.app` imports Ray itself.
"""
