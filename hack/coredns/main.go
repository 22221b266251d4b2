// CoreDNS with the plugins the local clusters need, as CoreDNS documents custom builds. The real nodes'
// Corefile uses the kubernetes plugin (Services, and a headless Service's pods by hostname and subdomain),
// bound to one address, with errors and queries logged; the kind node image (hack/kindnode.py) runs the
// Corefile kubeadm writes, which adds health, readiness, metrics, caching, forwarding, loop detection,
// reloading and load balancing. Built from the coredns module at COREDNS_VERSION (hack/versions.env) by
// hack/build-binaries.sh; the release's full plugin set would pull in every cloud provider's SDK for nothing.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func init() {
	// The order a query passes the plugins in, as in CoreDNS's own plugin.cfg.
	dnsserver.Directives = []string{
		"reload", "bind", "ready", "health", "prometheus", "errors", "log", "loadbalance", "cache",
		"kubernetes", "loop", "forward",
	}
}

func main() { coremain.Run() }
