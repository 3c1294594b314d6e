// Package netpol builds the upstream Kubernetes e2e NetworkPolicy specs ([sig-network] Netpol)
// into a test binary of their own, e2e-netpol.test (`go test -c`), for the real node of the
// test bed (.ci/e2e). TestMain and TestE2E do what test/e2e/e2e_test.go does for e2e.test,
// with only the netpol specs imported.
package netpol

import (
	"flag"
	"os"
	"testing"

	"k8s.io/kubernetes/test/e2e"
	"k8s.io/kubernetes/test/e2e/framework"
	"k8s.io/kubernetes/test/e2e/framework/config"
	"k8s.io/kubernetes/test/e2e/framework/testfiles"
	e2etestingmanifests "k8s.io/kubernetes/test/e2e/testing-manifests"

	// the specs: [sig-network] Netpol
	_ "k8s.io/kubernetes/test/e2e/network/netpol"

	// as in e2e_test.go: frozen feature constants and the framework's reconfiguration
	_ "k8s.io/kubernetes/test/e2e/feature"
	_ "k8s.io/kubernetes/test/e2e/framework/debug/init"
	_ "k8s.io/kubernetes/test/e2e/framework/node/init"
)

func TestMain(m *testing.M) {
	config.CopyFlags(config.Flags, flag.CommandLine)
	framework.RegisterCommonFlags(flag.CommandLine)
	framework.RegisterClusterFlags(flag.CommandLine)
	flag.Parse()
	testfiles.AddFileSource(e2etestingmanifests.GetE2ETestingManifestsFS())
	framework.AfterReadingAllFlags(&framework.TestContext)
	os.Exit(m.Run())
}

func TestE2E(t *testing.T) {
	e2e.RunE2ETests(t)
}
