// Command etcd is etcd's own server (etcdmain), built inside this module so that it resolves
// from the module proxy: etcd's top-level module has relative replaces and cannot be installed.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
