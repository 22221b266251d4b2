"""The local stack: a control plane built from Go modules, the operator as a process, Kueue and the gang
schedulers, and three kinds of node, each for the tiers that need what it gives:

- KWOK nodes (cluster.py): fake nodes with GPUs whose pods never run; the integration tier and the soak, where
  many nodes, GPUs, node loss and faults matter and a pod's process does not;
- the node agent (nodeagent.py): the kubelet's part imitated, pods run as processes or as containers of the
  trainer image; `make demo` and the e2e tier, where whole jobs train and faults a kubelet cannot be made to
  show here (a frozen node, a zombie attempt) are injected;
- real nodes (realnode.py, nodeimages.py): the kubelet and containerd themselves; the realnode tier, for what
  only the kubelet decides (volumes, security contexts, tokens, signals, exit codes, the log, exec and
  port-forward streams, cluster DNS and the pod network) and whole trainer jobs across two such nodes.

kind (hack/kindnode.py, `make kind-e2e`) is apart from the stack and from `make test`: the flow users' CI
runs, where kubeadm sets the cluster up and kube-proxy routes Services.
"""
