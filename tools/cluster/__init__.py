"""The local Kubernetes control plane the cluster lane tests against, built from upstream source (docs/testing.md).

Usage:
    bash tools/cluster/build.sh      # build etcd, kube-apiserver, -controller-manager, -scheduler, Kueue, JobSet, kwok
    python -m tools.cluster up       # start them on 127.0.0.1; `down` stops them
"""
