// CoreDNS with the plugins the local stack's real nodes need, as CoreDNS documents custom builds: the
// kubernetes plugin answering the cluster domain from the API server (Services, and a headless Service's
// pods by hostname and subdomain), bound to one address, with errors and queries logged. Built from the
// coredns module at COREDNS_VERSION (hack/versions.env) by hack/build-binaries.sh; the release's full plugin
// set would pull in every cloud provider's SDK for nothing.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
)

func init() {
	// The order a query passes the plugins in, as in CoreDNS's own plugin.cfg.
	dnsserver.Directives = []string{"bind", "errors", "log", "kubernetes"}
}

func main() { coremain.Run() }
