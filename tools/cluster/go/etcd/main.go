// Command etcd is etcd's own server entry point, built from go.etcd.io/etcd/server/v3 at the version go.mod pins,
// for the local control plane (docs/testing.md). etcd's root module keeps its main behind local replace lines, so
// this module calls the same etcdmain.Main that it does.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
