// Command loader creates a benchmark's cluster through the API server, fast: many workers over
// client-go v0.36 with protobuf bodies and no client-side rate limit. Test tool only, for
// bench/api_server_cost.py and bench/kube_router_side_by_side.py; never shipped.
//
// Input, on stdin: one API object a line (JSON: Nodes, Namespaces, NetworkPolicies, Pods, ...).
// They are created kind by kind in this order: Node, Namespace, NetworkPolicy, Pod (a kind's
// objects all exist before the next kind starts: pods need their namespace).
// A Pod's or Node's "status" is written after its creation through the status subresource, as a
// kubelet reports it. An object that exists already is taken as it is (a Namespace's labels are
// merged into it), so kube-system and retried creations pass.
//
// Output, on stdout: one JSON object, per kind {"count": n, "seconds": s} (s: wall time of that
// kind, creations and status writes). Errors: the first failing object's kind, name and the API
// error on stderr, exit status 1; bad input or flags exit 2.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/retry"
)

// kindOrder is the order in which kinds are created, and the kinds the loader creates.
var kindOrder = []string{"Node", "Namespace", "NetworkPolicy", "Pod"}

// perConnection is how many workers share one connection (HTTP/2 streams over one TLS session).
const perConnection = 16

type timing struct {
	Count   int     `json:"count"`
	Seconds float64 `json:"seconds"`
}

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the API server")
	workers := flag.Int("workers", 16, "objects created at once")
	flag.Parse()
	config, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil || *workers < 1 {
		fmt.Fprintln(os.Stderr, "loader: bad -kubeconfig or -workers:", err)
		os.Exit(2)
	}
	config.ContentType = runtime.ContentTypeProtobuf
	config.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	config.QPS = -1 // no client-side rate limiter: the API server's own flow control decides
	clients := make([]*kubernetes.Clientset, (*workers+perConnection-1)/perConnection)
	for i := range clients {
		own := *config
		// A Dial of its own keeps client-go from sharing one transport (and HTTP/2 connection).
		own.Dial = (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext
		clients[i] = kubernetes.NewForConfigOrDie(&own)
	}

	byKind := map[string][]runtime.Object{}
	input := bufio.NewScanner(os.Stdin)
	input.Buffer(make([]byte, 1<<20), 64<<20)
	for line := 1; input.Scan(); line++ {
		if len(input.Bytes()) == 0 {
			continue
		}
		obj, gvk, err := scheme.Codecs.UniversalDeserializer().Decode(input.Bytes(), nil, nil)
		if err != nil {
			fmt.Fprintf(os.Stderr, "loader: line %d of stdin: %v\n", line, err)
			os.Exit(2)
		}
		if !slices.Contains(kindOrder, gvk.Kind) {
			fmt.Fprintf(os.Stderr, "loader: line %d of stdin: kind %s is not one the loader creates (%v)\n", line, gvk.Kind, kindOrder)
			os.Exit(2)
		}
		byKind[gvk.Kind] = append(byKind[gvk.Kind], obj)
	}
	if err := input.Err(); err != nil {
		fmt.Fprintln(os.Stderr, "loader: reading stdin:", err)
		os.Exit(2)
	}

	ctx := context.Background()
	timings := map[string]timing{}
	for _, kind := range kindOrder {
		objects := byKind[kind]
		if len(objects) == 0 {
			continue
		}
		started := time.Now()
		if err := createAll(ctx, clients, *workers, objects); err != nil {
			fmt.Fprintln(os.Stderr, "loader:", err)
			os.Exit(1)
		}
		timings[kind] = timing{Count: len(objects), Seconds: time.Since(started).Seconds()}
	}
	out, _ := json.Marshal(timings)
	fmt.Println(string(out))
}

// createAll creates objects with workers goroutines (worker i on clients[i % len(clients)]);
// returns the first error.
func createAll(ctx context.Context, clients []*kubernetes.Clientset, workers int, objects []runtime.Object) error {
	next := make(chan runtime.Object)
	errs := make(chan error, workers)
	var wg sync.WaitGroup
	for i := 0; i < workers; i++ {
		wg.Add(1)
		go func(client *kubernetes.Clientset) {
			defer wg.Done()
			for obj := range next {
				if err := create(ctx, client, obj); err != nil {
					errs <- err
					for range next { // drain: the feeder stops at the first error
					}
					return
				}
			}
		}(clients[i%len(clients)])
	}
	var first error
feed:
	for _, obj := range objects {
		select {
		case next <- obj:
		case first = <-errs:
			break feed
		}
	}
	close(next)
	wg.Wait()
	if first == nil {
		select {
		case first = <-errs:
		default:
		}
	}
	return first
}

// create creates one object and then writes its status (Pods, Nodes).
func create(ctx context.Context, client *kubernetes.Clientset, obj runtime.Object) error {
	opts := metav1.CreateOptions{}
	switch o := obj.(type) {
	case *corev1.Namespace:
		_, err := client.CoreV1().Namespaces().Create(ctx, o, opts)
		if apierrors.IsAlreadyExists(err) && len(o.Labels) > 0 {
			patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": o.Labels}})
			_, err = client.CoreV1().Namespaces().Patch(ctx, o.Name, types.MergePatchType, patch, metav1.PatchOptions{})
		}
		return named("Namespace", o.Name, ignoreExists(err))
	case *networkingv1.NetworkPolicy:
		_, err := client.NetworkingV1().NetworkPolicies(o.Namespace).Create(ctx, o, opts)
		return named("NetworkPolicy", o.Namespace+"/"+o.Name, ignoreExists(err))
	case *corev1.Pod:
		pods := client.CoreV1().Pods(o.Namespace)
		stored, err := pods.Create(ctx, o, opts)
		if apierrors.IsAlreadyExists(err) {
			stored, err = pods.Get(ctx, o.Name, metav1.GetOptions{})
		}
		if err == nil && !isZero(o.Status) {
			err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
				stored.Status = o.Status
				_, err := pods.UpdateStatus(ctx, stored, metav1.UpdateOptions{})
				if apierrors.IsConflict(err) {
					stored, _ = pods.Get(ctx, o.Name, metav1.GetOptions{})
				}
				return err
			})
		}
		return named("Pod", o.Namespace+"/"+o.Name, err)
	case *corev1.Node:
		nodes := client.CoreV1().Nodes()
		stored, err := nodes.Create(ctx, o, opts)
		if apierrors.IsAlreadyExists(err) {
			stored, err = nodes.Get(ctx, o.Name, metav1.GetOptions{})
		}
		if err == nil && !isZero(o.Status) {
			err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
				stored.Status = o.Status
				_, err := nodes.UpdateStatus(ctx, stored, metav1.UpdateOptions{})
				if apierrors.IsConflict(err) {
					stored, _ = nodes.Get(ctx, o.Name, metav1.GetOptions{})
				}
				return err
			})
		}
		return named("Node", o.Name, err)
	}
	panic(fmt.Sprintf("%T is not in kindOrder", obj))
}

func isZero[T any](status T) bool {
	var zero T
	a, _ := json.Marshal(status)
	b, _ := json.Marshal(zero)
	return string(a) == string(b)
}

func ignoreExists(err error) error {
	if apierrors.IsAlreadyExists(err) {
		return nil
	}
	return err
}

func named(kind, name string, err error) error {
	if err != nil {
		return fmt.Errorf("%s %s: %w", kind, name, err)
	}
	return nil
}
