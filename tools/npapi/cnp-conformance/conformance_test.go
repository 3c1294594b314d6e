// Package cnpconformance builds the ClusterNetworkPolicy conformance suite of
// sigs.k8s.io/network-policy-api (its conformance/tests, run by its utils/suite) into a test
// binary of its own, cnp-conformance.test, for the real node of the test bed (.ci/e2e).
//
// TestConformance does what the module's own TestConformance does (conformance_test.go: the
// clients from the kubeconfig, the v1alpha2 scheme, suite.New, Setup, Run) with one difference:
// the manifests it applies are ./base, which .ci/install copies from the module's
// conformance/base at build time with the SCTP servers taken out of base/manifests.yaml (this
// test bed's kernel has no SCTP: agnhost porter exits when it cannot listen on SCTP, so the
// suite's StatefulSets would never become Ready and Setup would fail before any test). The
// SCTP tests themselves are skipped by the caller (-test.skip).
package cnpconformance

import (
	"embed"
	"testing"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/config"

	api "sigs.k8s.io/network-policy-api/apis/v1alpha2"
	"sigs.k8s.io/network-policy-api/conformance/tests"
	"sigs.k8s.io/network-policy-api/conformance/utils/flags"
	"sigs.k8s.io/network-policy-api/conformance/utils/suite"
)

// The suite's manifests (base/manifests.yaml and the tests' base/admin_tier, base/baseline_tier,
// base/api_integration), laid here by .ci/install; never committed.
//
//go:embed base
var manifests embed.FS

func TestConformance(t *testing.T) {
	cfg, err := config.GetConfig()
	if err != nil {
		t.Fatalf("kubeconfig: %v", err)
	}
	c, err := client.New(cfg, client.Options{})
	if err != nil {
		t.Fatalf("client: %v", err)
	}
	restConfig, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(
		clientcmd.NewDefaultClientConfigLoadingRules(), &clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil {
		t.Fatalf("kubeconfig for client-go: %v", err)
	}
	clientSet, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		t.Fatalf("clientset: %v", err)
	}
	if err := api.Install(c.Scheme()); err != nil {
		t.Fatalf("v1alpha2 scheme: %v", err)
	}
	t.Logf("supported features: [%v], exempt features: [%v]", *flags.SupportedFeatures, *flags.ExemptFeatures)
	conformance := suite.New(suite.Options{
		Client:                     c,
		ClientSet:                  clientSet,
		KubeConfig:                 *cfg,
		Debug:                      *flags.ShowDebug,
		CleanupBaseResources:       *flags.CleanupBaseResources,
		SupportedFeatures:          suite.ParseSupportedFeatures(*flags.SupportedFeatures),
		ExemptFeatures:             suite.ParseSupportedFeatures(*flags.ExemptFeatures),
		EnableAllSupportedFeatures: *flags.EnableAllSupportedFeatures,
		FS:                         &manifests,
	})
	conformance.Setup(t)
	conformance.Run(t, tests.ConformanceTests)
}
