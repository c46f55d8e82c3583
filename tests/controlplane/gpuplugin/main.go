// Command gpuplugin is a stand-in for NVIDIA's device plugin, for nodes with no GPU: it speaks
// the kubelet's device-plugin API (v1beta1) and advertises --count devices of --resource, so
// GPU-shaped pods schedule and the kubelet allocates devices to them as on a GPU node.
//
// What it does as the real plugin does: it registers through the kubelet's plugin watcher (a
// socket in <kubelet root>/plugins_registry, so each kubelet on one machine finds its own plugin;
// the legacy /var/lib/kubelet/device-plugins/kubelet.sock is one path per machine), lists its
// devices as Healthy, and answers Allocate with NVIDIA_VISIBLE_DEVICES naming the devices given
// to the container, the variable the NVIDIA container toolkit reads. What it does not: no device
// node, no driver library and no CDI spec reaches the container; there is no GPU to give.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"google.golang.org/grpc"
	deviceplugin "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	registration "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// VisibleDevices is the variable the NVIDIA container toolkit reads to choose a container's GPUs.
const VisibleDevices = "NVIDIA_VISIBLE_DEVICES"

type plugin struct {
	deviceplugin.UnimplementedDevicePluginServer
	registration.UnimplementedRegistrationServer

	resource string
	endpoint string // the DevicePlugin service's socket
	devices  []*deviceplugin.Device
	stop     chan struct{}
}

// Registration service: what the kubelet's plugin watcher asks the socket it finds.

func (p *plugin) GetInfo(context.Context, *registration.InfoRequest) (*registration.PluginInfo, error) {
	return &registration.PluginInfo{
		Type:              registration.DevicePlugin,
		Name:              p.resource,
		Endpoint:          p.endpoint,
		SupportedVersions: []string{deviceplugin.Version},
	}, nil
}

func (p *plugin) NotifyRegistrationStatus(_ context.Context, status *registration.RegistrationStatus) (*registration.RegistrationStatusResponse, error) {
	if status.PluginRegistered {
		log.Printf("registered with the kubelet as %s", p.resource)
	} else {
		log.Printf("the kubelet refused the registration: %s", status.Error)
	}
	return &registration.RegistrationStatusResponse{}, nil
}

// DevicePlugin service: what the kubelet's device manager asks once registered.

func (p *plugin) GetDevicePluginOptions(context.Context, *deviceplugin.Empty) (*deviceplugin.DevicePluginOptions, error) {
	return &deviceplugin.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *deviceplugin.Empty, stream grpc.ServerStreamingServer[deviceplugin.ListAndWatchResponse]) error {
	if err := stream.Send(&deviceplugin.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	select { // the devices never change; the stream stays open until either side ends
	case <-stream.Context().Done():
	case <-p.stop:
	}
	return nil
}

func (p *plugin) GetPreferredAllocation(context.Context, *deviceplugin.PreferredAllocationRequest) (*deviceplugin.PreferredAllocationResponse, error) {
	return &deviceplugin.PreferredAllocationResponse{}, nil
}

func (p *plugin) Allocate(_ context.Context, request *deviceplugin.AllocateRequest) (*deviceplugin.AllocateResponse, error) {
	response := &deviceplugin.AllocateResponse{}
	for _, container := range request.ContainerRequests {
		ids := strings.Join(container.DevicesIds, ",")
		log.Printf("allocate %s", ids)
		response.ContainerResponses = append(response.ContainerResponses, &deviceplugin.ContainerAllocateResponse{
			Envs: map[string]string{VisibleDevices: ids},
		})
	}
	return response, nil
}

func (p *plugin) PreStartContainer(context.Context, *deviceplugin.PreStartContainerRequest) (*deviceplugin.PreStartContainerResponse, error) {
	return &deviceplugin.PreStartContainerResponse{}, nil
}

func serve(path string, register func(*grpc.Server)) (*grpc.Server, error) {
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	listener, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	server := grpc.NewServer()
	register(server)
	go func() {
		if err := server.Serve(listener); err != nil {
			log.Printf("serving %s: %v", path, err)
		}
	}()
	return server, nil
}

func main() {
	registry := flag.String("registry-dir", "", "the kubelet's plugin watcher directory (<root-dir>/plugins_registry)")
	socketDir := flag.String("socket-dir", "", "where the DevicePlugin service's socket goes")
	resource := flag.String("resource", "nvidia.com/gpu", "the extended resource advertised")
	count := flag.Int("count", 2, "devices advertised")
	node := flag.String("node", "", "the node's name, in the device IDs")
	flag.Parse()
	if *registry == "" || *socketDir == "" || *node == "" || *count < 0 {
		fmt.Fprintln(os.Stderr, "gpuplugin: --registry-dir, --socket-dir and --node are required, --count >= 0")
		os.Exit(2)
	}
	log.SetPrefix("gpuplugin: ")
	p := &plugin{
		resource: *resource,
		endpoint: filepath.Join(*socketDir, "gpuplugin.sock"),
		stop:     make(chan struct{}),
	}
	for i := 0; i < *count; i++ {
		// NVIDIA's IDs are GPU-<uuid>; these say what they are.
		id := fmt.Sprintf("GPU-standin-%s-%d", *node, i)
		p.devices = append(p.devices, &deviceplugin.Device{ID: id, Health: deviceplugin.Healthy})
	}
	// The DevicePlugin service first: the kubelet dials it as soon as it reads the registration.
	plugins, err := serve(p.endpoint, func(s *grpc.Server) { deviceplugin.RegisterDevicePluginServer(s, p) })
	if err != nil {
		log.Fatalf("serving the device plugin: %v", err)
	}
	registrations, err := serve(filepath.Join(*registry, "gpuplugin-reg.sock"), func(s *grpc.Server) {
		registration.RegisterRegistrationServer(s, p)
	})
	if err != nil {
		log.Fatalf("serving the registration: %v", err)
	}
	log.Printf("advertising %d x %s on node %s", *count, *resource, *node)
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	<-signals
	close(p.stop)
	registrations.Stop() // its socket goes: the watcher deregisters the plugin
	plugins.Stop()
	os.Remove(filepath.Join(*registry, "gpuplugin-reg.sock"))
	os.Remove(p.endpoint)
}
