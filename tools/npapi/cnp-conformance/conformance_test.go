// Package cnpconformance builds the ClusterNetworkPolicy conformance suite of
// sigs.k8s.io/network-policy-api v0.3.0 (its conformance/tests, run by its utils/suite, both
// unchanged) into a test binary of its own, cnp-conformance.test, for the real node of the test
// bed (.ci/e2e).
//
// TestConformance does what the module's own TestConformanceProfiles does with
// --conformance-profiles set (conformance/conformance_profile_test.go: the clients from the
// kubeconfig, the v1beta1 and apiextensions schemes, suite.ParseImplementation,
// suite.NewConformanceProfileTestSuite, Setup, Run, Report, the report as YAML in
// --report-output), with one difference: the manifests come through the suite's own option for
// them (suite.Options.FS) from ./base, which .ci/install copies from the module's
// conformance/base at build time with the SCTP servers taken out of base/manifests.yaml
// (tools/npapi/manifests.py: this test bed's kernel has no SCTP sockets, agnhost porter exits
// when it cannot listen on SCTP, so the suite's StatefulSets would never become Ready and Setup
// would fail before any test). Every test runs, the SCTP ones included; their SCTP probes fail
// here, and the report counts them failed.
package cnpconformance

import (
	"embed"
	"os"
	"testing"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/config"
	"sigs.k8s.io/yaml"

	api "sigs.k8s.io/network-policy-api/apis/v1beta1"
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
		t.Fatalf("v1beta1 scheme: %v", err)
	}
	if err := apiextensionsv1.AddToScheme(c.Scheme()); err != nil {
		t.Fatalf("apiextensions scheme: %v", err)
	}
	implementation, err := suite.ParseImplementation(*flags.ImplementationOrganization, *flags.ImplementationProject,
		*flags.ImplementationURL, *flags.ImplementationVersion, *flags.ImplementationContact,
		*flags.ImplementationAdditionalInformation)
	if err != nil {
		t.Fatalf("implementation: %v", err)
	}
	t.Logf("supported features: [%v], exempt features: [%v], all features: %t, profiles: [%v]",
		*flags.SupportedFeatures, *flags.ExemptFeatures, *flags.EnableAllSupportedFeatures, *flags.ConformanceProfiles)
	conformance, err := suite.NewConformanceProfileTestSuite(suite.ConformanceProfileOptions{
		Options: suite.Options{
			Client:                     c,
			ClientSet:                  clientSet,
			KubeConfig:                 *cfg,
			Debug:                      *flags.ShowDebug,
			CleanupBaseResources:       *flags.CleanupBaseResources,
			SupportedFeatures:          suite.ParseSupportedFeatures(*flags.SupportedFeatures),
			ExemptFeatures:             suite.ParseSupportedFeatures(*flags.ExemptFeatures),
			EnableAllSupportedFeatures: *flags.EnableAllSupportedFeatures,
			FS:                         &manifests,
		},
		Implementation:      *implementation,
		ConformanceProfiles: suite.ParseConformanceProfiles(*flags.ConformanceProfiles),
	})
	if err != nil {
		t.Fatalf("conformance profile suite: %v", err)
	}
	conformance.Setup(t)
	if err := conformance.Run(t, tests.ConformanceTests); err != nil {
		t.Fatalf("run: %v", err)
	}
	report, err := conformance.Report()
	if err != nil {
		t.Fatalf("report: %v", err)
	}
	raw, err := yaml.Marshal(report)
	if err != nil {
		t.Fatalf("report as YAML: %v", err)
	}
	if *flags.ReportOutput != "" {
		if err := os.WriteFile(*flags.ReportOutput, raw, 0o644); err != nil {
			t.Fatalf("report: %v", err)
		}
	}
	t.Logf("Conformance report:\n%s", raw)
}
