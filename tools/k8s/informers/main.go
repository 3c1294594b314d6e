// Command informers runs -count independent sets of client-go informers, each set as one
// kube-router-like agent would open them: Pods and NetworkPolicies of all namespaces, Namespaces
// and Nodes, every set on its own connection to
// the API server (a transport of its own, as a separate process has). Test tool only, for
// bench/api_server_cost.py; never shipped.
//
// Output, one JSON object a line on stdout: {"agent": i, "synced_s": seconds from the start
// until all four informers of set i had synced (their initial list, or streaming list when the
// WatchListClient feature of client-go is on: KUBE_FEATURE_WatchListClient=false turns it off)};
// then "ready"; when stdin is closed, {"events": n} (add, update and delete notifications over
// all sets) and the command exits.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the API server")
	count := flag.Int("count", 1, "informer sets (simulated agents)")
	flag.Parse()
	config, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		fmt.Fprintln(os.Stderr, "informers:", err)
		os.Exit(2)
	}
	config.QPS, config.Burst = 50, 100
	var events atomic.Int64
	count64 := func(any) { events.Add(1) }
	handler := cache.ResourceEventHandlerFuncs{
		AddFunc: count64, DeleteFunc: count64, UpdateFunc: func(_, obj any) { count64(obj) },
	}
	ctx, cancel := context.WithCancel(context.Background())
	start := time.Now()
	var out sync.Mutex
	var wg sync.WaitGroup
	for i := 0; i < *count; i++ {
		own := *config
		// A Dial of its own keeps client-go from sharing one cached transport (and HTTP/2
		// connection) between the sets: each is one agent's connection.
		own.Dial = (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext
		client := kubernetes.NewForConfigOrDie(&own)
		all := informers.NewSharedInformerFactory(client, 0)
		synced := []cache.InformerSynced{}
		for _, informer := range []cache.SharedIndexInformer{
			all.Core().V1().Pods().Informer(), all.Core().V1().Namespaces().Informer(),
			all.Networking().V1().NetworkPolicies().Informer(), all.Core().V1().Nodes().Informer(),
		} {
			if _, err := informer.AddEventHandler(handler); err != nil {
				panic(err)
			}
			synced = append(synced, informer.HasSynced)
		}
		all.Start(ctx.Done())
		wg.Add(1)
		go func(agent int) {
			defer wg.Done()
			cache.WaitForCacheSync(ctx.Done(), synced...)
			line, _ := json.Marshal(map[string]any{"agent": agent, "synced_s": time.Since(start).Seconds()})
			out.Lock()
			fmt.Println(string(line))
			out.Unlock()
		}(i)
	}
	wg.Wait()
	fmt.Println(`"ready"`)
	_, _ = io.Copy(io.Discard, os.Stdin)
	line, _ := json.Marshal(map[string]any{"events": events.Load()})
	fmt.Println(string(line))
	cancel()
}
